#pragma once
// Rebalancing: the timings daemons report, the cost table measured from
// them, the automatic rebalance they may trigger (CoordinatorOptions
// rebalance_*) and the operator's Rebalance request. A new plan is appended
// to the job's history as its next version, activating a margin after the
// latest reported step so every daemon switches at the same step. Not
// thread-safe: CoordinatorCore calls it under its mutex.
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/coordinator_options.h"
#include "server/coordinator/job.h"
#include "server/coordinator/job_planner.h"

namespace muond {

class Rebalancer {
 public:
  // Not owned; each must outlive the rebalancer.
  Rebalancer(const CoordinatorOptions& options, const JobPlanner* planner,
             CoordinatorMetrics* metrics)
      : options_(options), planner_(planner), metrics_(metrics) {}

  // InvalidArgument: a shape entry that is not 2-D with positive dims, with
  // count < 1 or a non-finite or negative ns_us.
  static absl::Status CheckTimings(const v1::ReportTimingsRequest& request);
  // Keeps the rank's latest step timings and, per shape, its latest measured
  // NS time (a request CheckTimings accepted); may push an automatic
  // rebalance.
  void Record(Job& job, Daemon& daemon,
              const v1::ReportTimingsRequest& request);

  // Per shape, the NS time of one matrix in microseconds (sum of ns_us / sum
  // of count over every rank's latest measurement of that shape); shapes
  // measured as 0 are left out (the planner estimates them).
  static CostTable MeasuredCosts(const Job& job);

  // The checks of a Rebalance that need no job; returns its explicit cost
  // table. InvalidArgument: activate_after_steps < 1, an unknown cost model,
  // a cost table entry that is not 2-D or has a non-positive or non-finite
  // cost.
  static absl::StatusOr<CostTable> CheckRequest(
      const v1::RebalanceRequest& request);
  // Plans the job again and appends the plan (a request CheckRequest
  // accepted, with its table). FailedPrecondition: a registration round in
  // progress, no plan yet, COST_MODEL_MEASURED with nothing measured.
  // InvalidArgument: an activation step past int64.
  absl::StatusOr<v1::Plan> Rebalance(Job& job,
                                     const v1::RebalanceRequest& request,
                                     const CostTable& explicit_costs);

 private:
  // The automatic rebalance of CoordinatorOptions, checked after a report.
  void MaybeRebalance(Job& job);

  const CoordinatorOptions& options_;
  const JobPlanner* const planner_;
  CoordinatorMetrics* const metrics_;
};

}  // namespace muond
