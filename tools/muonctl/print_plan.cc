// How status and rebalance print a plan (PrintPlan, coordinator_commands.h).
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "core/plan/planner.h"
#include "server/common/proto_convert.h"
#include "tools/muonctl/coordinator_commands.h"

namespace muond::muonctl {
namespace {

// The operator's name of a plan's cost model ("measured"), as --cost_model
// takes it.
std::string CostModelNameOf(v1::CostModel model) {
  absl::StatusOr<CostModel> core = FromProto(model, "cost_model");
  return core.ok() ? std::string(CostModelName(*core))
                   : v1::CostModel_Name(model);
}

// Each domain rank's share of the group's NS load (flat rank (d * G + g) * T
// + t): with a DP axis of D replicas about 1/D each.
void PrintLoadShares(const v1::GroupPlan& g, std::ostream& out) {
  double total = 0;
  for (double l : g.rank_load()) total += l;
  if (!(total > 0)) return;
  out << "    NS load share per domain rank:";
  for (int r = 0; r < g.rank_load_size(); ++r) {
    out << " " << r << ":"
        << absl::StrFormat("%.1f%%", 100 * g.rank_load(r) / total);
  }
  out << "\n";
}

// How many params each replica is home to, when a DP axis spreads them.
void PrintReplicaHomes(const v1::GroupPlan& g, std::ostream& out) {
  std::map<int, int> per_replica;
  for (const v1::NsHome& h : g.homes()) ++per_replica[h.d()];
  if (per_replica.size() < 2 && per_replica.count(0)) return;
  out << "    homes per replica:";
  for (const auto& [d, n] : per_replica) out << " d" << d << ":" << n;
  out << "\n";
}

}  // namespace

void PrintPlan(const v1::Plan& plan, std::ostream& out) {
  out << "plan version " << plan.version() << ", activates at step "
      << plan.activate_at_step() << ", cost model '"
      << CostModelNameOf(plan.cost_model()) << "'\n";
  for (const v1::GroupPlan& g : plan.groups()) {
    if (g.homes_size() == 0) {
      // AdamW's per-rank groups route nothing: their load, shares and
      // replica homes are all empty, so one short line says so.
      out << "  group " << g.group() << ": no routed homes\n";
      continue;
    }
    out << "  group " << g.group() << ": " << g.homes_size()
        << " routed homes, max/mean " << g.max_over_mean()
        << ", max/lower_bound " << g.lower_bound_ratio() << "\n";
    if (g.rank_load_size() > 0) {
      out << "    rank load:";
      for (double l : g.rank_load()) out << " " << l;
      out << "\n";
      PrintLoadShares(g, out);
    }
    PrintReplicaHomes(g, out);
  }
}

}  // namespace muond::muonctl
