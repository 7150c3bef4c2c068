#pragma once
// NS-home assignment: which rank of a D x G x T domain assembles each routed
// 2-D weight and runs Newton–Schulz on it (docs/ARCHITECTURE.md "Plans and
// their versions").
//
// Load model (one "item" per param with a home, cost c from the cost model;
// flat rank (d*G + g)*T + t):
//   * GTP_REMAT (TP-replicated): every TP rank of the home row runs the same
//     NS, so the item adds c to all T ranks of row (d, g) (t_home is 0).
//   * TP (G == 1) and GTP_REMAT_AND_TP: the item adds c to one rank (d, g, t).
//   * REPLICATED (within the G x T grid): without a DP axis (D == 1) not
//     routed: adds c to every rank (home {0, 0, 0}); with D > 1 an item whose
//     home is a replica d: adds c to all G*T ranks of replica d (home
//     {0, 0, d}); the other replicas receive its update.
// With D > 1 every item also gets its home replica d; the other replicas skip
// its exchanges and NS. D == 1 gives exactly the plans of the G x T planner.
// Balancing is deterministic longest-processing-time-first: items by cost
// descending (ties: replica items, then row items, then rank items, then
// shape, then name), each to the least-loaded eligible home (ties: lowest
// index). With colocate_same_shape an
// item goes to a home already holding its shape when that does not raise the
// running maximum beyond what the least-loaded choice would give; the result
// is kept only if its final max load is not worse than plain LPT. Either way
// a matrix whose rows one GTP rank holds (gtp_rows with one nonzero entry: an
// expert FSDP2 keeps whole on a rank) goes to that rank's row when that keeps
// every load within plain LPT's max, so its exchanges move nothing.
#include <cstdint>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/plan/sharding.h"

namespace muond {

struct NsHome {
  int g = 0;
  int t = 0;
  int d = 0;  // the home replica on a DP axis (0 without one)
  bool operator==(const NsHome& o) const {
    return g == o.g && t == o.t && d == o.d;
  }
};

enum CostModel {
  kNsCost,    // NsCost(P, Q) = max * min^2 (Megatron's proxy)
  kFlops,     // NsFlops(P, Q, ns_steps, symmetric_ns): the kernel path's FLOPs
  kMeasured,  // measured_cost[(P, Q)] (e.g. seconds per NS), from rebalancing
};

// "ns_cost", "flops", "measured": the names operators type (muonctl) and the
// wire enum muond.v1.CostModel spells in upper case.
std::string_view CostModelName(CostModel model);
// Inverse of CostModelName; InvalidArgument naming `field` and the names.
absl::StatusOr<CostModel> ParseCostModel(std::string_view name,
                                         std::string_view field = "cost_model");

struct PlannerOptions {
  CostModel cost = kNsCost;
  bool colocate_same_shape = true;
  // kFlops: the NS kernel path actually used.
  int ns_steps = 5;
  bool symmetric_ns = false;
  // kMeasured: cost of one NS on a full matrix of shape (rows, cols). A shape
  // missing from the table is estimated as NsFlops * the median
  // (measured / NsFlops) ratio of the table's shapes.
  std::map<std::pair<int64_t, int64_t>, double> measured_cost;
  // Added to every routed or replicated matrix's cost (per-NS launch
  // overhead, in the cost model's units). 0 by default.
  double per_matrix_cost = 0;
};

// The SYRK Newton-Schulz path's FLOPs, as operators name it among the cost
// models: not a CostModel of its own but kFlops with
// PlannerOptions::symmetric_ns.
inline constexpr std::string_view kFlopsSyrkName = "flops_syrk";

// The cost of an offline plan (muonctl plan --cost), which has no measurements:
// "ns_cost", "flops" or "flops_syrk" (kFlops on the SYRK path). Sets
// options.cost and options.symmetric_ns; InvalidArgument naming `field` and
// the accepted names for any other name ("measured" included).
absl::Status SetOfflineCost(std::string_view name, std::string_view field,
                            PlannerOptions& options);

struct HomePlan {
  // One per spec, in spec order. Replicated params get {0, 0} and are not
  // routed (with D > 1: {0, 0, d}, their home replica); GTP_REMAT params get
  // t = 0 (their whole home row runs NS).
  std::vector<NsHome> homes;
  // Per flat domain rank (d * G + g) * T + t (all_ranks() entries), cost
  // units.
  std::vector<double> rank_load;
  double max_over_mean = 1;  // max(rank_load) / mean(rank_load)
  // max(total / all ranks, largest item) + the replicated load on every
  // rank.
  double lower_bound = 0;
  double lower_bound_ratio = 1;  // max(rank_load) / lower_bound
  bool round_robin_fallback = false;
  bool colocated = false;  // the same-shape colocating result was kept
};

// The cost of one NS on each spec's full matrix under `options`, in spec
// order. Errors: a measured table with a non-positive entry, or kMeasured
// with an empty table (message names the first param it could not cost).
absl::StatusOr<std::vector<double>> ParamCosts(
    const std::vector<ParamShardSpec>& specs, const PlannerOptions& options);

// Deterministic LPT over the D x G x T ranks. Same specs in any order -> the
// same home for every name. Errors: invalid domain or spec (ValidateShardSpec),
// duplicate names, cost-model errors.
absl::StatusOr<HomePlan> PlanNsHomes(const std::vector<ParamShardSpec>& specs,
                                     DomainSize domain,
                                     const PlannerOptions& options = {});

// Explicit fallback only: the i-th routed param goes to home i mod (number of
// eligible homes of its kind over the D x G x T ranks), in spec order;
// Megatron's (i % G, 0) for GTP_REMAT when D == 1. Logs a loud warning that LPT
// balancing is NOT in effect. Loads are reported with options' cost model
// (kNsCost if that model fails). Specs are assumed valid for `domain`.
HomePlan RoundRobinHomes(const std::vector<ParamShardSpec>& specs,
                         DomainSize domain, const PlannerOptions& options = {});

// Fills rank_load, max_over_mean, lower_bound and lower_bound_ratio of `plan`
// for its homes (used by both planners; public for tools and tests).
absl::Status ComputePlanLoads(const std::vector<ParamShardSpec>& specs,
                              const std::vector<double>& costs,
                              DomainSize domain, HomePlan& plan);

}  // namespace muond
