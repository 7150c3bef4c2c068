#pragma once
// muond-coordinator's metrics (server/README.md "Metrics" lists them):
// counters the core bumps once per event, and per-job gauges read from the
// core's state at each scrape (a collector), so a job that expires leaves
// no stale series behind.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/common/metrics.h"

namespace muond {

// One job as the gauges show it.
struct JobMetricsSnapshot {
  std::string job;
  int live_daemons = 0;
  int64_t plan_version = 0;  // the newest plan's; 0: none yet
  // Rank -> its share of the newest plan's NS cost (NsLoadShare).
  std::map<int, double> ns_load;
};

class CoordinatorMetrics {
 public:
  // The families in a registry of its own.
  CoordinatorMetrics();

  // What muond-coordinator serves on --metrics_port.
  MetricsRegistry& registry() { return *registry_; }

  // Where the per-job gauges come from at each scrape (the core's
  // MetricsSnapshot); must stay callable while the registry is served.
  void CollectJobsFrom(std::function<std::vector<JobMetricsSnapshot>()> jobs);

  // `job` appeared (its first Join): its counters start at 0, so a
  // dashboard's rate()/increase() sees the first increment.
  void JobCreated(const std::string& job);
  // A plan version was added to `job` (a new registration round's, or a
  // rebalance's when `rebalance`).
  void PlanBuilt(const std::string& job, bool rebalance);
  // Planning failed; the reason label is the status's code name.
  void PlanBuildFailed(const absl::Status& status);
  // A joined rank of `job` published (a manifest, or its refusal notice).
  void ManifestReceived(const std::string& job);

 private:
  void Collect();

  const std::unique_ptr<MetricsRegistry> registry_;
  Gauge& jobs_;
  Family<Gauge>& daemons_;
  Family<Gauge>& plan_version_;
  Family<Gauge>& ns_load_;
  Family<Counter>& plans_built_;
  Family<Counter>& plan_build_failures_;
  Family<Counter>& manifests_;
  Family<Counter>& rebalances_;
  std::function<std::vector<JobMetricsSnapshot>()> jobs_source_;
};

}  // namespace muond
