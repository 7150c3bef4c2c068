#include "server/coordinator/coordinator_metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/version.h"

namespace muond {

CoordinatorMetrics::CoordinatorMetrics()
    : registry_(std::make_unique<MetricsRegistry>()),
      jobs_(registry_
                ->AddGauge("muond_coordinator_jobs",
                           "Jobs this coordinator holds (until they expire)")
                .With()),
      daemons_(registry_->AddGauge(
          "muond_coordinator_daemons",
          "Live daemons of the job (plan stream open, or joined within the "
          "join grace)",
          {"job"})),
      plan_version_(registry_->AddGauge(
          "muond_coordinator_plan_version",
          "Version of the job's newest plan (0: none yet)", {"job"})),
      ns_load_(registry_->AddGauge(
          "muond_coordinator_ns_load",
          "The rank's share of the job's newest plan's NS cost (its "
          "rank_load over the sum of every rank's), 0..1",
          {"job", "rank"})),
      plans_built_(registry_->AddCounter(
          "muond_coordinator_plans_built_total",
          "Plan versions built for the job (registration rounds and "
          "rebalances)",
          {"job"})),
      plan_build_failures_(registry_->AddCounter(
          "muond_coordinator_plan_build_failures_total",
          "Plannings that failed, by the error's gRPC code name", {"reason"})),
      manifests_(registry_->AddCounter(
          "muond_coordinator_manifests_total",
          "Manifests published by the job's joined daemons (re-publishes "
          "after a reconnect and refusal notices included)",
          {"job"})),
      rebalances_(registry_->AddCounter(
          "muond_coordinator_rebalances_total",
          "Rebalances of the job that built a new plan (muonctl rebalance "
          "or automatic)",
          {"job"})) {
  registry_
      ->AddGauge("muond_build_info", "muond's version; always 1", {"version"})
      .With({kMuondVersion})
      .Set(1);
  registry_->AddCollector([this] { Collect(); });
}

void CoordinatorMetrics::CollectJobsFrom(
    std::function<std::vector<JobMetricsSnapshot>()> jobs) {
  jobs_source_ = std::move(jobs);
}

void CoordinatorMetrics::Collect() {
  daemons_.Clear();
  plan_version_.Clear();
  ns_load_.Clear();
  if (!jobs_source_) return;
  const std::vector<JobMetricsSnapshot> jobs = jobs_source_();
  jobs_.Set(double(jobs.size()));
  for (const JobMetricsSnapshot& job : jobs) {
    daemons_.With({job.job}).Set(job.live_daemons);
    plan_version_.With({job.job}).Set(double(job.plan_version));
    for (const auto& [rank, load] : job.ns_load) {
      ns_load_.With({job.job, absl::StrCat(rank)}).Set(load);
    }
  }
}

void CoordinatorMetrics::JobCreated(const std::string& job) {
  plans_built_.With({job});
  manifests_.With({job});
  rebalances_.With({job});
}

void CoordinatorMetrics::PlanBuilt(const std::string& job, bool rebalance) {
  plans_built_.With({job}).Increment();
  if (rebalance) rebalances_.With({job}).Increment();
}

void CoordinatorMetrics::PlanBuildFailed(const absl::Status& status) {
  plan_build_failures_.With({absl::StatusCodeToString(status.code())})
      .Increment();
}

void CoordinatorMetrics::ManifestReceived(const std::string& job) {
  manifests_.With({job}).Increment();
}

}  // namespace muond
