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

// What an item's home is, by how many consecutive flat ranks (d*G + g)*T + t
// it loads: a whole replica's G x T grid (a param replicated within the grid,
// when the domain has a DP axis), a row of T ranks (a GTP_REMAT param: every
// TP rank of its home row runs the same NS) or one rank. The order is the
// tie-break order of ItemBefore (wider first).
enum class HomeKind { kReplica = 0, kRow = 1, kRank = 2 };

// Without a DP axis a param replicated within the grid runs NS on every rank
// and is no item.
bool IsItem(const ParamShardSpec& spec, DomainSize domain) {
  return spec.routed() || domain.dp > 1;
}

HomeKind KindOf(const ParamShardSpec& spec) {
  if (!spec.routed()) return HomeKind::kReplica;
  return spec.sharding == ParamSharding::kGtpRemat ? HomeKind::kRow
                                                   : HomeKind::kRank;
}

// Flat ranks one home of `kind` loads.
int WidthOf(HomeKind kind, DomainSize domain) {
  switch (kind) {
    case HomeKind::kReplica:
      return domain.ranks();
    case HomeKind::kRow:
      return domain.tp;
    case HomeKind::kRank:
      return 1;
  }
  return 1;
}

// Slot s of `kind` (replica d, row d*G + g, or flat rank) as a home.
NsHome HomeOfSlot(HomeKind kind, int slot, DomainSize domain) {
  switch (kind) {
    case HomeKind::kReplica:
      return NsHome{0, 0, slot};
    case HomeKind::kRow:
      return NsHome{slot % domain.gtp, 0, slot / domain.gtp};
    case HomeKind::kRank:
      return NsHome{(slot / domain.tp) % domain.gtp, slot % domain.tp,
                    slot / domain.ranks()};
  }
  return NsHome{};
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
  HomeKind kind;
  int64_t rows, cols;  // full shape, for ordering and colocation
  // The GTP rank holding every row of the matrix (an expert whose rows one
  // rank owns: gtp_rows with one nonzero entry), else -1.
  int owner_g = -1;
};

// OwnerG of a routed spec: the one g whose gtp_rows entry is nonzero when all
// others are 0 (a whole matrix on one GTP rank), else -1.
int OwnerG(const ParamShardSpec& spec) {
  if (!spec.routed() || spec.gtp_rows.size() < 2) return -1;
  int owner = -1;
  for (size_t g = 0; g < spec.gtp_rows.size(); ++g) {
    if (spec.gtp_rows[g] == 0) continue;
    if (owner >= 0) return -1;
    owner = int(g);
  }
  return owner;
}

// Total order that does not depend on input order: cost descending, wider
// items first (replica, row, rank), then shape; equal keys keep the
// (name-sorted) order they come in.
bool ItemBefore(const Item& a, const Item& b) {
  if (a.cost != b.cost) return a.cost > b.cost;
  if (a.kind != b.kind) return a.kind < b.kind;
  if (a.rows != b.rows) return a.rows < b.rows;
  return a.cols < b.cols;
}

struct ShapeKey {
  HomeKind kind;
  int64_t rows, cols;
  bool operator==(const ShapeKey& o) const {
    return kind == o.kind && rows == o.rows && cols == o.cols;
  }
  template <typename H>
  friend H AbslHashValue(H h, const ShapeKey& k) {
    return H::combine(std::move(h), k.kind, k.rows, k.cols);
  }
};

// One LPT pass. Returns the homes (a slot of the item's kind: replica d, row
// d*G + g or flat rank, per item in `items` order) and the final max load.
struct LptResult {
  std::vector<int> slot;  // per item
  double max_load = 0;
};

// The running loads of one LPT pass over the D x G x T ranks: per rank, and
// per row and replica their max and sum (kept incrementally, so a domain
// without a DP axis sees exactly the arithmetic of the G x T planner).
class LptLoads {
 public:
  explicit LptLoads(DomainSize domain)
      : domain_(domain),
        load_(domain.all_ranks(), 0.0),
        row_max_(domain.dp * domain.gtp, 0.0),
        row_sum_(domain.dp * domain.gtp, 0.0),
        rep_max_(domain.dp, 0.0),
        rep_sum_(domain.dp, 0.0) {}

  int NumSlots(HomeKind kind) const {
    return domain_.all_ranks() / WidthOf(kind, domain_);
  }
  // The busiest rank of slot s.
  double SlotMax(HomeKind kind, int s) const {
    switch (kind) {
      case HomeKind::kReplica:
        return rep_max_[s];
      case HomeKind::kRow:
        return row_max_[s];
      case HomeKind::kRank:
        return load_[s];
    }
    return 0;
  }
  // Slot a is a better home than b: lower max, then lower sum, then index.
  bool Better(HomeKind kind, int a, int b) const {
    switch (kind) {
      case HomeKind::kReplica:
        return std::tie(rep_max_[a], rep_sum_[a], a) <
               std::tie(rep_max_[b], rep_sum_[b], b);
      case HomeKind::kRow:
        return std::tie(row_max_[a], row_sum_[a], a) <
               std::tie(row_max_[b], row_sum_[b], b);
      case HomeKind::kRank:
        return std::tie(load_[a], a) < std::tie(load_[b], b);
    }
    return false;
  }
  void Add(HomeKind kind, int s, double cost) {
    const int T = domain_.tp, G = domain_.gtp;
    switch (kind) {
      case HomeKind::kReplica:
        for (int r = s * G; r < (s + 1) * G; ++r) AddRow(r, cost);
        break;
      case HomeKind::kRow:
        AddRow(s, cost);
        break;
      case HomeKind::kRank: {
        load_[s] += cost;
        const int row = s / T, rep = row / G;
        row_max_[row] = std::max(row_max_[row], load_[s]);
        row_sum_[row] += cost;
        rep_max_[rep] = std::max(rep_max_[rep], load_[s]);
        rep_sum_[rep] += cost;
        global_max_ = std::max(global_max_, load_[s]);
        break;
      }
    }
  }
  double global_max() const { return global_max_; }

 private:
  void AddRow(int row, double cost) {
    const int T = domain_.tp, rep = row / domain_.gtp;
    for (int t = 0; t < T; ++t) load_[row * T + t] += cost;
    row_max_[row] += cost;
    row_sum_[row] += cost * T;
    rep_max_[rep] = std::max(rep_max_[rep], row_max_[row]);
    rep_sum_[rep] += cost * T;
    global_max_ = std::max(global_max_, row_max_[row]);
  }

  const DomainSize domain_;
  std::vector<double> load_, row_max_, row_sum_, rep_max_, rep_sum_;
  double global_max_ = 0;
};

// The least-loaded slot of the item's owner row when it does not raise the
// running maximum beyond `best`'s (the LPT choice): its NS then runs where its
// rows are, and its exchanges move nothing. Else `best`.
int OwnerSlotIfNoWorse(const Item& item, int best, DomainSize domain,
                       const LptLoads& loads, double cap) {
  int owner = -1;
  for (int s = 0; s < loads.NumSlots(item.kind); ++s) {
    if (HomeOfSlot(item.kind, s, domain).g != item.owner_g) continue;
    if (owner < 0 || loads.Better(item.kind, s, owner)) owner = s;
  }
  if (owner < 0 || owner == best) return best;
  const double at_owner = loads.SlotMax(item.kind, owner) + item.cost;
  const double at_best = loads.SlotMax(item.kind, best) + item.cost;
  return at_owner <= std::max({loads.global_max(), at_best, cap}) ? owner
                                                                  : best;
}

// owner_cap < 0: no owner preference; else the max load an owner's slot may
// reach (plain LPT's: the preference must not cost balance).
LptResult RunLpt(const std::vector<Item>& items, DomainSize domain,
                 bool colocate, double owner_cap = -1) {
  LptLoads loads(domain);
  absl::flat_hash_map<ShapeKey, std::vector<int>> hosts;
  LptResult result;
  result.slot.resize(items.size());

  for (size_t k = 0; k < items.size(); ++k) {
    const Item& item = items[k];
    const HomeKind kind = item.kind;
    int best = 0;
    for (int s = 1; s < loads.NumSlots(kind); ++s) {
      if (loads.Better(kind, s, best)) best = s;
    }
    auto peak_after = [&](int s) { return loads.SlotMax(kind, s) + item.cost; };
    std::vector<int>* same_shape = nullptr;
    if (colocate) {
      same_shape = &hosts[ShapeKey{kind, item.rows, item.cols}];
      int best_host = -1;
      for (int s : *same_shape) {
        if (best_host < 0 || loads.Better(kind, s, best_host)) best_host = s;
      }
      if (best_host >= 0 && best_host != best &&
          peak_after(best_host) <=
              std::max(loads.global_max(), peak_after(best))) {
        best = best_host;
      }
    }
    if (item.owner_g >= 0 && owner_cap >= 0) {
      best = OwnerSlotIfNoWorse(item, best, domain, loads, owner_cap);
    }
    loads.Add(kind, best, item.cost);
    if (same_shape != nullptr &&
        std::find(same_shape->begin(), same_shape->end(), best) ==
            same_shape->end()) {
      same_shape->push_back(best);
    }
    result.slot[k] = best;
  }
  result.max_load = loads.global_max();
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

// A lower bound on the max item load of any plan, from the items' (cost,
// kind) pairs: max(total rank load / all ranks, largest item) and, when every
// item has the same kind (m homes of it), total / m and the pair bound
// c[m-1] + c[m] over costs sorted descending (among the m + 1 largest items
// two share a home).
double ItemLowerBound(const std::vector<std::pair<double, HomeKind>>& items,
                      DomainSize domain) {
  std::vector<double> costs;
  costs.reserve(items.size());
  double total = 0, total_rank_load = 0, largest = 0;
  bool one_kind = true;
  for (const auto& [c, kind] : items) {
    const int width = WidthOf(kind, domain);
    costs.push_back(c);
    total += c;
    total_rank_load += kind == HomeKind::kRank ? c : c * width;
    largest = std::max(largest, c);
    one_kind &= kind == items.front().second;
  }
  double bound = largest;
  if (!items.empty() && one_kind) {
    const int homes =
        domain.all_ranks() / WidthOf(items.front().second, domain);
    bound = std::max(bound, total / homes);
    if (int(costs.size()) > homes) {
      std::nth_element(costs.begin(), costs.begin() + homes, costs.end(),
                       std::greater<double>());
      const double c_m = costs[homes];  // (m+1)-th largest
      const double c_m1 =
          *std::min_element(costs.begin(), costs.begin() + homes);
      bound = std::max(bound, c_m1 + c_m);
    }
  }
  return std::max(bound, total_rank_load / domain.all_ranks());
}

double ItemLowerBound(const std::vector<Item>& items, DomainSize domain) {
  std::vector<std::pair<double, HomeKind>> pairs;
  pairs.reserve(items.size());
  for (const Item& item : items) pairs.push_back({item.cost, item.kind});
  return ItemLowerBound(pairs, domain);
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
  const int all_ranks = domain.all_ranks();
  if (plan.homes.size() != specs.size() || costs.size() != specs.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan has ", plan.homes.size(), " homes and ",
                     costs.size(), " costs for ", specs.size(), " specs"));
  }
  plan.rank_load.assign(all_ranks, 0.0);
  double replicated = 0;
  std::vector<std::pair<double, HomeKind>> items;
  for (size_t i = 0; i < specs.size(); ++i) {
    const double c = costs[i];
    const NsHome& h = plan.homes[i];
    if (!IsItem(specs[i], domain)) {
      replicated += c;
      for (double& l : plan.rank_load) l += c;
      continue;
    }
    if (!domain.Contains(h.d, h.g, h.t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "param '", specs[i].name, "': home (", h.g, ", ", h.t,
          domain.dp > 1 ? absl::StrCat(", d=", h.d) : "", ") outside the ",
          domain.dp > 1 ? absl::StrCat(domain.dp, "x") : "", domain.gtp, "x",
          domain.tp, " domain"));
    }
    const HomeKind kind = KindOf(specs[i]);
    const int width = WidthOf(kind, domain);
    const int slot = kind == HomeKind::kReplica ? h.d
                     : kind == HomeKind::kRow   ? h.d * domain.gtp + h.g
                                              : domain.FlatRank(h.d, h.g, h.t);
    for (int r = slot * width; r < (slot + 1) * width; ++r) {
      plan.rank_load[r] += c;
    }
    items.push_back({c, kind});
  }
  const double max_load =
      *std::max_element(plan.rank_load.begin(), plan.rank_load.end());
  const double mean =
      std::accumulate(plan.rank_load.begin(), plan.rank_load.end(), 0.0) /
      all_ranks;
  plan.max_over_mean = mean > 0 ? max_load / mean : 1.0;
  plan.lower_bound = replicated + ItemLowerBound(items, domain);
  plan.lower_bound_ratio =
      plan.lower_bound > 0 ? max_load / plan.lower_bound : 1.0;
  return absl::OkStatus();
}

absl::StatusOr<HomePlan> PlanNsHomes(const std::vector<ParamShardSpec>& specs,
                                     DomainSize domain,
                                     const PlannerOptions& options) {
  if (domain.gtp < 1 || domain.tp < 1 || domain.dp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("domain sizes must be >= 1, got G=", domain.gtp,
                     " T=", domain.tp, " D=", domain.dp));
  }
  ASSIGN_OR_RETURN(const std::vector<int> by_name,
                   CheckSpecsAndSortByName(specs, domain));
  ASSIGN_OR_RETURN(std::vector<double> costs, ParamCosts(specs, options));

  std::vector<Item> items;
  items.reserve(specs.size());
  for (int i : by_name) {
    const ParamShardSpec& spec = specs[i];
    if (IsItem(spec, domain)) {
      items.push_back(Item{i, costs[i], KindOf(spec), spec.full_shape[0],
                           spec.full_shape[1], OwnerG(spec)});
    }
  }
  std::stable_sort(items.begin(), items.end(), ItemBefore);

  HomePlan plan;
  // Matrices with an owner rank stay there up to plain LPT's max load.
  const bool owners = std::any_of(items.begin(), items.end(),
                                  [](const Item& i) { return i.owner_g >= 0; });
  const double cap =
      owners ? RunLpt(items, domain, /*colocate=*/false).max_load : -1;
  LptResult chosen = RunLpt(items, domain, options.colocate_same_shape, cap);
  plan.colocated = options.colocate_same_shape;
  if (options.colocate_same_shape &&
      chosen.max_load > ItemLowerBound(items, domain) * (1 + 1e-12)) {
    // Colocating did not reach the bound: keep it only if plain LPT is not
    // better.
    LptResult plain = RunLpt(items, domain, /*colocate=*/false, cap);
    if (plain.max_load < chosen.max_load) {
      chosen = std::move(plain);
      plan.colocated = false;
    }
  }
  if (owners && chosen.max_load > cap) {
    chosen = RunLpt(items, domain, /*colocate=*/false);  // balance first
    plan.colocated = false;
  }
  plan.homes.assign(specs.size(), NsHome{});
  for (size_t k = 0; k < items.size(); ++k) {
    plan.homes[items[k].spec] =
        HomeOfSlot(items[k].kind, chosen.slot[k], domain);
  }
  RETURN_IF_ERROR(ComputePlanLoads(specs, costs, domain, plan));
  return plan;
}

HomePlan RoundRobinHomes(const std::vector<ParamShardSpec>& specs,
                         DomainSize domain, const PlannerOptions& options) {
  LOG(WARNING) << "##### ROUND-ROBIN NS HOMES IN USE for " << specs.size()
               << " params on a "
               << (domain.dp > 1 ? absl::StrCat(domain.dp, "x") : "")
               << domain.gtp << "x" << domain.tp
               << " domain: LPT load balancing is NOT in effect; expect an "
                  "unbalanced Newton-Schulz step #####";
  HomePlan plan;
  plan.round_robin_fallback = true;
  plan.homes.assign(specs.size(), NsHome{});
  int k = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!IsItem(specs[i], domain)) continue;
    const HomeKind kind = KindOf(specs[i]);
    const int slots = domain.all_ranks() / WidthOf(kind, domain);
    plan.homes[i] = HomeOfSlot(kind, k % slots, domain);
    ++k;
  }
  absl::StatusOr<std::vector<double>> costs = ParamCosts(specs, options);
  if (!costs.ok()) costs = ParamCosts(specs, PlannerOptions{});
  if (costs.ok()) ComputePlanLoads(specs, *costs, domain, plan).IgnoreError();
  return plan;
}

}  // namespace muond
