#include "server/coordinator/rebalancer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/checked_math.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/manifest_checks.h"
#include "server/coordinator/registration_rounds.h"

namespace muond {
namespace {

bool SameHomes(const v1::Plan& a, const v1::Plan& b) {
  std::map<std::string, const v1::GroupPlan*> by_name;
  for (const v1::GroupPlan& g : b.groups()) by_name[g.group()] = &g;
  if (a.groups_size() != int(by_name.size())) return false;
  for (const v1::GroupPlan& g : a.groups()) {
    auto it = by_name.find(g.group());
    if (it == by_name.end() || it->second->homes_size() != g.homes_size()) {
      return false;
    }
    for (int i = 0; i < g.homes_size(); ++i) {
      if (FromProto(g.homes(i)) != FromProto(it->second->homes(i))) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

absl::Status Rebalancer::CheckTimings(const v1::ReportTimingsRequest& request) {
  for (const v1::ShapeTiming& s : request.shapes()) {
    if (s.shape_size() != 2 || s.shape(0) < 1 || s.shape(1) < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("shapes: entry ", ShapeString(s.shape()),
                       " must be 2-D with positive dims"));
    }
    if (s.count() < 1 || !(s.ns_us() >= 0) || !std::isfinite(s.ns_us())) {
      return absl::InvalidArgumentError(
          absl::StrCat("shapes: entry ", ShapeString(s.shape()),
                       " needs count >= 1 and a finite ns_us >= 0"));
    }
  }
  return absl::OkStatus();
}

void Rebalancer::Record(Job& job, Daemon& daemon,
                        const v1::ReportTimingsRequest& request) {
  daemon.last_step_id = std::max(daemon.last_step_id, request.step_id());
  daemon.last_timings = request.timings();
  for (const v1::ShapeTiming& s : request.shapes()) {
    daemon.shape_times[{s.shape(0), s.shape(1)}] = {s.ns_us(), s.count()};
  }
  MaybeRebalance(job);
}

CostTable Rebalancer::MeasuredCosts(const Job& job) {
  std::map<std::vector<int64_t>, std::pair<double, int64_t>> sums;
  for (const auto& [rank, d] : job.daemons) {
    for (const auto& [shape, sc] : d.shape_times) {
      sums[shape].first += sc.first;
      sums[shape].second += sc.second;
    }
  }
  CostTable costs;
  for (const auto& [shape, sc] : sums) {
    const double per_matrix = sc.first / double(sc.second);
    // The planner needs positive costs; it estimates shapes left out.
    if (per_matrix > 0) costs[shape] = per_matrix;
  }
  return costs;
}

void Rebalancer::MaybeRebalance(Job& job) {
  if (options_.rebalance_threshold <= 0 || job.plans.empty() ||
      !CheckNoRoundInProgress(job).ok() ||
      int(job.daemons.size()) != job.world_size) {
    return;
  }
  int64_t oldest = std::numeric_limits<int64_t>::max(), latest = -1;
  double max_ns = 0, sum_ns = 0;
  for (const auto& [rank, d] : job.daemons) {
    oldest = std::min(oldest, d.last_step_id);
    latest = std::max(latest, d.last_step_id);
    max_ns = std::max(max_ns, d.last_timings.ns_us());
    sum_ns += d.last_timings.ns_us();
  }
  // Every rank's latest timings must come from the current plan and the
  // previous check must be `interval` steps ago (hysteresis).
  const int64_t interval =
      std::max<int64_t>(1, options_.rebalance_interval_steps);
  const int64_t since = std::max(job.plans.newest()->activate_at_step(),
                                 job.last_rebalance_check_step);
  if (oldest < 0 || oldest - since < interval) return;
  job.last_rebalance_check_step = oldest;
  const double mean_ns = sum_ns / double(job.world_size);
  if (!(mean_ns > 0)) return;
  const double imbalance = max_ns / mean_ns;
  if (imbalance <= options_.rebalance_threshold) {
    VLOG(1) << "job " << job.id << ": NS max/mean " << imbalance << " at step "
            << oldest << " is within the threshold "
            << options_.rebalance_threshold;
    return;
  }
  const CostTable costs = MeasuredCosts(job);
  if (costs.empty()) {
    LOG(WARNING) << "job " << job.id << ": NS max/mean " << imbalance
                 << " exceeds " << options_.rebalance_threshold
                 << " but no daemon reported shape timings; not rebalancing";
    return;
  }
  const std::optional<int64_t> activate = CheckedAdd(
      latest, std::max<int64_t>(1, options_.rebalance_activate_margin));
  if (!activate) {
    LOG(WARNING) << "job " << job.id << ": latest reported step " << latest
                 << " plus the activation margin overflows; not rebalancing";
    return;
  }
  absl::StatusOr<v1::Plan> plan =
      planner_->NextPlan(job, costs, v1::COST_MODEL_MEASURED, *activate);
  if (!plan.ok()) {
    LOG(WARNING) << "job " << job.id
                 << ": automatic rebalance failed: " << plan.status();
    return;
  }
  if (SameHomes(*plan, *job.plans.newest())) {
    LOG(INFO) << "job " << job.id << ": NS max/mean " << imbalance
              << " exceeds " << options_.rebalance_threshold
              << " but the measured cost table gives the same homes; "
                 "keeping plan version "
              << job.plans.newest()->version();
    return;
  }
  if (absl::Status st = job.plans.Append(*std::move(plan)); !st.ok()) {
    LOG(WARNING) << "job " << job.id << ": automatic rebalance failed: " << st;
    return;
  }
  metrics_->PlanBuilt(job.id, /*rebalance=*/true);
  LOG(INFO) << "job " << job.id << ": NS max/mean " << imbalance << " exceeds "
            << options_.rebalance_threshold
            << "; automatic rebalance to plan version "
            << job.plans.newest()->version() << " (measured, " << costs.size()
            << " shapes), activating at step "
            << job.plans.newest()->activate_at_step();
}

absl::StatusOr<CostTable> Rebalancer::CheckRequest(
    const v1::RebalanceRequest& request) {
  if (request.has_activate_after_steps() &&
      request.activate_after_steps() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("activate_after_steps: ", request.activate_after_steps(),
                     " must be >= 1 (unset: 2)"));
  }
  const v1::CostModel model = request.cost_model();
  if (!v1::CostModel_IsValid(model)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cost_model: value ", model,
                     " is not one of COST_MODEL_NS_COST, COST_MODEL_FLOPS, "
                     "COST_MODEL_MEASURED (or unset)"));
  }
  CostTable explicit_costs;
  for (const v1::ShapeTiming& s : request.cost_table()) {
    if (s.shape_size() != 2 || s.shape(0) < 1 || s.shape(1) < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("cost_table: shape ", ShapeString(s.shape()),
                       " must be 2-D with positive dims"));
    }
    if (!std::isfinite(s.ns_us()) || s.ns_us() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cost_table: shape ", ShapeString(s.shape()),
                       " has cost ", s.ns_us(), "; needs a finite cost > 0"));
    }
    explicit_costs[{s.shape(0), s.shape(1)}] = s.ns_us();
  }
  return explicit_costs;
}

absl::StatusOr<v1::Plan> Rebalancer::Rebalance(
    Job& job, const v1::RebalanceRequest& request,
    const CostTable& explicit_costs) {
  const v1::CostModel model = request.cost_model();
  RETURN_IF_ERROR(CheckNoRoundInProgress(job));
  if (job.plans.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id, "' has no complete set of manifests to plan from"));
  }
  // After a coordinator restart no daemon may have reported timings yet; the
  // steps they published with their manifests count too, or the plan would
  // activate at a step already past and each rank would switch whenever the
  // plan reaches it.
  int64_t latest_step = job.plans.resume_step();
  for (const auto& [rank, d] : job.daemons) {
    latest_step = std::max(latest_step, d.last_step_id);
  }
  // Mean measured time per matrix, over every daemon's latest reports.
  const CostTable measured = MeasuredCosts(job);
  CostTable costs;
  const bool unspecified = model == v1::COST_MODEL_UNSPECIFIED;
  v1::CostModel used_model = unspecified ? v1::COST_MODEL_NS_COST : model;
  if (model == v1::COST_MODEL_MEASURED || (unspecified && !measured.empty())) {
    if (measured.empty() && explicit_costs.empty()) {
      return absl::FailedPreconditionError(
          "cost_model COST_MODEL_MEASURED: no daemon has reported shape "
          "timings");
    }
    costs = measured;
    used_model = v1::COST_MODEL_MEASURED;
  }
  for (const auto& [shape, cost] : explicit_costs) costs[shape] = cost;
  // An explicit table is a measured table (shapes it lacks are estimated by
  // the planner from the table's cost/FLOP ratio).
  if (!explicit_costs.empty()) used_model = v1::COST_MODEL_MEASURED;
  const int64_t after =
      request.has_activate_after_steps() ? request.activate_after_steps() : 2;
  const std::optional<int64_t> activate = CheckedAdd(latest_step, after);
  if (!activate) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activate_after_steps: ", after, " after the latest reported step ",
        latest_step, " overflows int64"));
  }
  ASSIGN_OR_RETURN(v1::Plan plan,
                   planner_->NextPlan(job, costs, used_model, *activate));
  RETURN_IF_ERROR(job.plans.Append(plan));
  metrics_->PlanBuilt(job.id, /*rebalance=*/true);
  LOG(INFO) << "job " << job.id << ": rebalanced to plan version "
            << plan.version() << " (" << used_model << "), activating at step "
            << plan.activate_at_step();
  return plan;
}

}  // namespace muond
