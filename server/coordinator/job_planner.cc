#include "server/coordinator/job_planner.h"

#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/manifest_checks.h"

namespace muond {

absl::StatusOr<v1::Plan> JobPlanner::NextPlan(const Job& job,
                                              const CostTable& costs,
                                              v1::CostModel cost_model,
                                              int64_t activate_at_step) const {
  absl::StatusOr<v1::Plan> plan =
      PlanJob(job, costs, cost_model, activate_at_step);
  if (!plan.ok()) metrics_->PlanBuildFailed(plan.status());
  return plan;
}

absl::StatusOr<v1::Plan> JobPlanner::PlanJob(const Job& job,
                                             const CostTable& costs,
                                             v1::CostModel cost_model,
                                             int64_t activate_at_step) const {
  // Per group: the manifest of the lowest rank and the (g, t) coverage.
  struct GroupInfo {
    const v1::GroupManifest* manifest = nullptr;
    std::set<std::tuple<int, int, int>> coords;  // (d, g, t)
  };
  std::map<std::string, GroupInfo> groups;
  for (const auto& [rank, daemon] : job.daemons) {
    for (const v1::GroupManifest& g : daemon.manifest.groups()) {
      GroupInfo& info = groups[g.group()];
      if (info.manifest == nullptr) info.manifest = &g;
      info.coords.insert({g.domain().d(), g.domain().g(), g.domain().t()});
    }
  }
  v1::Plan plan;
  plan.set_job_id(job.id);
  plan.set_version(job.plans.NextVersion());
  plan.set_activate_at_step(activate_at_step);
  plan.set_cost_model(cost_model);
  for (const auto& [name, info] : groups) {
    const v1::Domain& d = info.manifest->domain();
    const size_t expected =
        size_t(DpSizeOf(d)) * size_t(d.gtp_size()) * size_t(d.tp_size());
    if (info.coords.size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", name, "': ", info.coords.size(), " of the ", expected,
          " ranks of domain '", d.name(), "' (", DomainText(d),
          ") published it; every rank of the domain must"));
    }
    v1::GroupPlan* group_plan = plan.add_groups();
    if (info.manifest->algorithm() == v1::ALGORITHM_ADAMW) {
      group_plan->set_group(name);
      continue;
    }
    if (!planner_) {
      return absl::InternalError("coordinator has no planner configured");
    }
    absl::StatusOr<v1::GroupPlan> computed =
        planner_(*info.manifest, cost_model, costs);
    if (!computed.ok()) {
      return WithContext(computed.status(),
                         absl::StrCat("planning group '", name, "': "));
    }
    *group_plan = *std::move(computed);
    group_plan->set_group(name);
    if (group_plan->homes_size() != info.manifest->params_size()) {
      return absl::InternalError(absl::StrCat(
          "planner returned ", group_plan->homes_size(), " homes for the ",
          info.manifest->params_size(), " params of group '", name, "'"));
    }
  }
  return plan;
}

}  // namespace muond
