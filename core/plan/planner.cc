#include "core/plan/planner.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"

namespace muond {
namespace {

// A GTP_REMAT param loads every rank of its home row; other routed params
// load one rank.
bool IsRowItem(const ParamShardSpec& spec) {
  return spec.sharding == ParamSharding::kGtpRemat;
}

absl::StatusOr<double> MedianSecondsPerFlop(const PlannerOptions& options) {
  std::vector<double> ratios;
  for (const auto& [shape, cost] : options.measured_cost) {
    if (!(cost > 0) || !std::isfinite(cost) || shape.first <= 0 ||
        shape.second <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "measured cost table: entry for shape [", shape.first, ", ",
          shape.second, "] is ", cost, "; shapes and costs must be > 0"));
    }
    ratios.push_back(cost / NsFlops(shape.first, shape.second, options.ns_steps,
                                    options.symmetric_ns));
  }
  if (ratios.empty()) return 0.0;
  std::sort(ratios.begin(), ratios.end());
  const size_t n = ratios.size();
  return n % 2 ? ratios[n / 2] : 0.5 * (ratios[n / 2 - 1] + ratios[n / 2]);
}

struct Item {
  int spec;
  double cost;
  bool row;
  int64_t rows, cols;  // full shape, for ordering and colocation
};

// Total order that does not depend on input order: cost descending, row items
// first, then shape; equal keys keep the (name-sorted) order they come in.
bool ItemBefore(const Item& a, const Item& b) {
  if (a.cost != b.cost) return a.cost > b.cost;
  if (a.row != b.row) return a.row;
  if (a.rows != b.rows) return a.rows < b.rows;
  return a.cols < b.cols;
}

struct ShapeKey {
  bool row;
  int64_t rows, cols;
  bool operator==(const ShapeKey& o) const {
    return row == o.row && rows == o.rows && cols == o.cols;
  }
  template <typename H>
  friend H AbslHashValue(H h, const ShapeKey& k) {
    return H::combine(std::move(h), k.row, k.rows, k.cols);
  }
};

// One LPT pass. Returns the homes (flat rank for single items, row for row
// items, per item in `items` order) and the final max load.
struct LptResult {
  std::vector<int> slot;  // per item
  double max_load = 0;
};

LptResult RunLpt(const std::vector<Item>& items, DomainSize domain,
                 bool colocate) {
  const int G = domain.gtp, T = domain.tp;
  std::vector<double> load(domain.ranks(), 0.0);
  std::vector<double> row_max(G, 0.0), row_sum(G, 0.0);
  double global_max = 0;
  absl::flat_hash_map<ShapeKey, std::vector<int>> hosts;
  LptResult result;
  result.slot.resize(items.size());

  auto better_row = [&](int a, int b) {
    return std::tie(row_max[a], row_sum[a], a) <
           std::tie(row_max[b], row_sum[b], b);
  };
  auto better_rank = [&](int a, int b) {
    return std::tie(load[a], a) < std::tie(load[b], b);
  };

  for (size_t k = 0; k < items.size(); ++k) {
    const Item& item = items[k];
    const int num_slots = item.row ? G : G * T;
    int best = 0;
    for (int s = 1; s < num_slots; ++s) {
      if (item.row ? better_row(s, best) : better_rank(s, best)) best = s;
    }
    auto peak_after = [&](int s) {
      return (item.row ? row_max[s] : load[s]) + item.cost;
    };
    std::vector<int>* same_shape = nullptr;
    if (colocate) {
      same_shape = &hosts[ShapeKey{item.row, item.rows, item.cols}];
      int best_host = -1;
      for (int s : *same_shape) {
        if (best_host < 0 ||
            (item.row ? better_row(s, best_host) : better_rank(s, best_host))) {
          best_host = s;
        }
      }
      if (best_host >= 0 && best_host != best &&
          peak_after(best_host) <= std::max(global_max, peak_after(best))) {
        best = best_host;
      }
    }
    if (item.row) {
      for (int t = 0; t < T; ++t) load[best * T + t] += item.cost;
      row_max[best] += item.cost;
      row_sum[best] += item.cost * T;
      global_max = std::max(global_max, row_max[best]);
    } else {
      load[best] += item.cost;
      const int g = best / T;
      row_max[g] = std::max(row_max[g], load[best]);
      row_sum[g] += item.cost;
      global_max = std::max(global_max, load[best]);
    }
    if (same_shape != nullptr &&
        std::find(same_shape->begin(), same_shape->end(), best) ==
            same_shape->end()) {
      same_shape->push_back(best);
    }
    result.slot[k] = best;
  }
  result.max_load = global_max;
  return result;
}

// Validates every spec and returns the spec indices sorted by name (the
// stable tie-break key); a name may appear only once.
absl::StatusOr<std::vector<int>> CheckSpecsAndSortByName(
    const std::vector<ParamShardSpec>& specs, DomainSize domain) {
  std::vector<int> by_name(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    RETURN_IF_ERROR(ValidateShardSpec(specs[i], domain));
    by_name[i] = int(i);
  }
  std::sort(by_name.begin(), by_name.end(),
            [&](int a, int b) { return specs[a].name < specs[b].name; });
  for (size_t k = 1; k < by_name.size(); ++k) {
    if (specs[by_name[k]].name == specs[by_name[k - 1]].name) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param '", specs[by_name[k]].name,
          "': duplicate name (names are the planner's stable tie-break key)"));
    }
  }
  return by_name;
}

// A lower bound on the max routed load of any plan: max(total / ranks,
// largest item) and, when every item has the same kind (m homes of one rank
// or one row each), the pair bound c[m-1] + c[m] over costs sorted descending
// (among the m + 1 largest items two share a home).
double RoutedLowerBound(std::vector<double> costs, int num_row_items,
                        DomainSize domain) {
  double total = 0, largest = 0;
  for (double c : costs) {
    total += c;
    largest = std::max(largest, c);
  }
  const int num_items = int(costs.size());
  double bound = largest;
  const bool all_rows = num_row_items == num_items;
  const bool no_rows = num_row_items == 0;
  if (all_rows || no_rows) {
    const int homes = all_rows ? domain.gtp : domain.ranks();
    bound = std::max(bound, total / homes);
    if (num_items > homes) {
      std::nth_element(costs.begin(), costs.begin() + homes, costs.end(),
                       std::greater<double>());
      const double c_m = costs[homes];  // (m+1)-th largest
      const double c_m1 =
          *std::min_element(costs.begin(), costs.begin() + homes);
      bound = std::max(bound, c_m1 + c_m);
    }
  }
  return bound;
}

double RoutedLowerBound(const std::vector<Item>& items, DomainSize domain) {
  std::vector<double> costs;
  costs.reserve(items.size());
  int rows = 0;
  double total_rank_load = 0;
  for (const Item& item : items) {
    costs.push_back(item.cost);
    rows += item.row;
    total_rank_load += item.row ? item.cost * domain.tp : item.cost;
  }
  return std::max(RoutedLowerBound(std::move(costs), rows, domain),
                  total_rank_load / domain.ranks());
}

}  // namespace

std::string_view CostModelName(CostModel model) {
  switch (model) {
    case kNsCost:
      return "ns_cost";
    case kFlops:
      return "flops";
    case kMeasured:
      return "measured";
  }
  return "unknown";
}

absl::StatusOr<CostModel> ParseCostModel(std::string_view name,
                                         std::string_view field) {
  for (CostModel model : {kNsCost, kFlops, kMeasured}) {
    if (CostModelName(model) == name) return model;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(field), ": '", std::string(name),
                   "' is not one of ns_cost, flops, measured"));
}

absl::Status SetOfflineCost(std::string_view name, std::string_view field,
                            PlannerOptions& options) {
  const bool syrk = name == kFlopsSyrkName;
  absl::StatusOr<CostModel> model = syrk ? kFlops : ParseCostModel(name, field);
  // kMeasured plans from a table of measured NS times, which an offline plan
  // does not have.
  if (!model.ok() || *model == kMeasured) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(field), " must be ", std::string(CostModelName(kNsCost)),
        ", ", std::string(CostModelName(kFlops)), " or ",
        std::string(kFlopsSyrkName), ", got '", std::string(name), "'"));
  }
  options.cost = *model;
  options.symmetric_ns = syrk;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> ParamCosts(
    const std::vector<ParamShardSpec>& specs, const PlannerOptions& options) {
  double seconds_per_flop = 0;
  if (options.cost == kMeasured) {
    ASSIGN_OR_RETURN(seconds_per_flop, MedianSecondsPerFlop(options));
  }
  std::vector<double> costs;
  costs.reserve(specs.size());
  for (const ParamShardSpec& spec : specs) {
    if (spec.full_shape.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("param '", spec.name, "': full shape is not 2-D"));
    }
    const int64_t rows = spec.full_shape[0], cols = spec.full_shape[1];
    double cost = 0;
    switch (options.cost) {
      case kNsCost:
        cost = NsCost(rows, cols);
        break;
      case kFlops:
        cost = NsFlops(rows, cols, options.ns_steps, options.symmetric_ns);
        break;
      case kMeasured: {
        auto it = options.measured_cost.find({rows, cols});
        if (it != options.measured_cost.end()) {
          cost = it->second;
        } else if (seconds_per_flop > 0) {
          cost = seconds_per_flop *
                 NsFlops(rows, cols, options.ns_steps, options.symmetric_ns);
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("param '", spec.name,
                           "': cost model is kMeasured but the "
                           "measured cost table is empty"));
        }
        break;
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("unknown cost model ", int(options.cost)));
    }
    costs.push_back(cost + options.per_matrix_cost);
  }
  return costs;
}

absl::Status ComputePlanLoads(const std::vector<ParamShardSpec>& specs,
                              const std::vector<double>& costs,
                              DomainSize domain, HomePlan& plan) {
  const int G = domain.gtp, T = domain.tp, ranks = domain.ranks();
  if (plan.homes.size() != specs.size() || costs.size() != specs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan has ", plan.homes.size(), " homes and ",
                     costs.size(), " costs for ", specs.size(), " specs"));
  }
  plan.rank_load.assign(ranks, 0.0);
  double replicated = 0, routed_total = 0;
  std::vector<double> routed_costs;
  int row_items = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const double c = costs[i];
    const NsHome& h = plan.homes[i];
    if (!specs[i].routed()) {
      replicated += c;
      for (double& l : plan.rank_load) l += c;
      continue;
    }
    if (!domain.Contains(h.g, h.t)) {
      return absl::InvalidArgumentError(
          absl::StrCat("param '", specs[i].name, "': home (", h.g, ", ", h.t,
                       ") outside the ", G, "x", T, " domain"));
    }
    routed_costs.push_back(c);
    if (IsRowItem(specs[i])) {
      ++row_items;
      for (int t = 0; t < T; ++t) plan.rank_load[domain.FlatRank(h.g, t)] += c;
      routed_total += c * T;
    } else {
      plan.rank_load[domain.FlatRank(h.g, h.t)] += c;
      routed_total += c;
    }
  }
  const double max_load =
      *std::max_element(plan.rank_load.begin(), plan.rank_load.end());
  const double mean =
      std::accumulate(plan.rank_load.begin(), plan.rank_load.end(), 0.0) /
      ranks;
  plan.max_over_mean = mean > 0 ? max_load / mean : 1.0;
  plan.lower_bound =
      replicated + std::max(routed_total / ranks,
                            RoutedLowerBound(routed_costs, row_items, domain));
  plan.lower_bound_ratio =
      plan.lower_bound > 0 ? max_load / plan.lower_bound : 1.0;
  return absl::OkStatus();
}

absl::StatusOr<HomePlan> PlanNsHomes(const std::vector<ParamShardSpec>& specs,
                                     DomainSize domain,
                                     const PlannerOptions& options) {
  if (domain.gtp < 1 || domain.tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "domain sizes must be >= 1, got G=", domain.gtp, " T=", domain.tp));
  }
  ASSIGN_OR_RETURN(const std::vector<int> by_name,
                   CheckSpecsAndSortByName(specs, domain));
  ASSIGN_OR_RETURN(std::vector<double> costs, ParamCosts(specs, options));

  std::vector<Item> items;
  items.reserve(specs.size());
  for (int i : by_name) {
    const ParamShardSpec& spec = specs[i];
    if (spec.routed()) {
      items.push_back(Item{i, costs[i], IsRowItem(spec), spec.full_shape[0],
                           spec.full_shape[1]});
    }
  }
  std::stable_sort(items.begin(), items.end(), ItemBefore);

  HomePlan plan;
  LptResult chosen = RunLpt(items, domain, options.colocate_same_shape);
  plan.colocated = options.colocate_same_shape;
  if (options.colocate_same_shape &&
      chosen.max_load > RoutedLowerBound(items, domain) * (1 + 1e-12)) {
    // Colocating did not reach the bound: keep it only if plain LPT is not
    // better.
    LptResult plain = RunLpt(items, domain, /*colocate=*/false);
    if (plain.max_load < chosen.max_load) {
      chosen = std::move(plain);
      plan.colocated = false;
    }
  }
  plan.homes.assign(specs.size(), NsHome{});
  for (size_t k = 0; k < items.size(); ++k) {
    const int slot = chosen.slot[k];
    plan.homes[items[k].spec] =
        items[k].row ? NsHome{slot, 0}
                     : NsHome{slot / domain.tp, slot % domain.tp};
  }
  RETURN_IF_ERROR(ComputePlanLoads(specs, costs, domain, plan));
  return plan;
}

HomePlan RoundRobinHomes(const std::vector<ParamShardSpec>& specs,
                         DomainSize domain, const PlannerOptions& options) {
  LOG(WARNING) << "##### ROUND-ROBIN NS HOMES IN USE for " << specs.size()
               << " params on a " << domain.gtp << "x" << domain.tp
               << " domain: LPT load balancing is NOT in effect; expect an "
                  "unbalanced Newton-Schulz step #####";
  HomePlan plan;
  plan.round_robin_fallback = true;
  plan.homes.assign(specs.size(), NsHome{});
  int k = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!specs[i].routed()) continue;
    if (IsRowItem(specs[i])) {
      plan.homes[i] = NsHome{k % domain.gtp, 0};
    } else {
      const int f = k % domain.ranks();
      plan.homes[i] = NsHome{f / domain.tp, f % domain.tp};
    }
    ++k;
  }
  absl::StatusOr<std::vector<double>> costs = ParamCosts(specs, options);
  if (!costs.ok()) costs = ParamCosts(specs, PlannerOptions{});
  if (costs.ok()) ComputePlanLoads(specs, *costs, domain, plan).IgnoreError();
  return plan;
}

}  // namespace muond
