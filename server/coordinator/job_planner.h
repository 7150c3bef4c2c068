#pragma once
// Planning a job: one plan (the job's next version) from the manifests its
// ranks published, each Muon group planned by the GroupPlanner, AdamW groups
// with no homes. Reads the Job, changes nothing; callers append the plan.
#include <cstdint>
#include <utility>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/coordinator_options.h"
#include "server/coordinator/job.h"

namespace muond {

class JobPlanner {
 public:
  // `metrics` (not owned) counts planning failures.
  JobPlanner(GroupPlanner planner, CoordinatorMetrics* metrics)
      : planner_(std::move(planner)), metrics_(metrics) {}

  // The job's next plan (PlanHistory::NextVersion), from the manifest of
  // each group's lowest rank. InvalidArgument: a group not published by
  // every rank of its domain; the planner's error, naming the group;
  // Internal: no planner, or one that returned the wrong number of homes.
  // A failure is counted (CoordinatorMetrics::PlanBuildFailed).
  absl::StatusOr<v1::Plan> NextPlan(const Job& job, const CostTable& costs,
                                    v1::CostModel cost_model,
                                    int64_t activate_at_step) const;

 private:
  // NextPlan without counting its failure.
  absl::StatusOr<v1::Plan> PlanJob(const Job& job, const CostTable& costs,
                                   v1::CostModel cost_model,
                                   int64_t activate_at_step) const;

  const GroupPlanner planner_;
  CoordinatorMetrics* const metrics_;
};

}  // namespace muond
