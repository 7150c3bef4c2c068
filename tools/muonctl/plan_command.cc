#include "tools/muonctl/plan_command.h"

#include <limits>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/plan/manifest.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"
#include "nlohmann/json.hpp"
#include "server/common/flag_spelling.h"

namespace muond::muonctl {
namespace {

constexpr char kUsage[] =
    "usage: muonctl plan --manifest FILE --gtp G --tp T [--dp D]\n"
    "                    [--cost ns_cost|flops|flops_syrk] [--ns_steps N]\n"
    "                    [--no_colocate] [--round_robin]\n"
    "Plans Newton-Schulz homes offline for a D x G x T (dp x gtp x tp)\n"
    "domain and prints the plan as JSON. Talks to no daemon.\n"
    "  --manifest FILE  param manifest (JSON, core/plan/manifest.h); required\n"
    "  --gtp G          group tensor-parallel size, >= 1; required\n"
    "  --tp T           tensor-parallel size, >= 1; required\n"
    "  --dp D           data-parallel replicas, >= 1 (default 1): each param\n"
    "                   gets a home replica, rank_load has D*G*T entries\n"
    "  --cost C         ns_cost (default), flops or flops_syrk\n"
    "  --ns_steps N     Newton-Schulz iterations (default 5)\n"
    "  --no_colocate    do not keep same-shape params on one home\n"
    "  --round_robin    round-robin homes instead of the planner\n"
    "  --help           this text\n"
    "Flags are snake_case; the dashed spelling (--ns-steps) works too.\n";

struct PlanArgs {
  std::string manifest;
  static constexpr int kUnset = std::numeric_limits<int>::min();
  int gtp = kUnset, tp = kUnset;  // required
  int dp = 1;
  std::string cost = "ns_cost";
  int ns_steps = 5;
  bool colocate = true;
  bool round_robin = false;
  PlannerOptions planner;  // cost and symmetric_ns, from `cost`
};

// Accepts "--flag value" and "--flag=value", a dashed name as its snake_case
// spelling (--ns-steps is --ns_steps). Returns an error message or "".
std::string ParseArgs(const std::vector<std::string>& args, PlanArgs& out) {
  const std::map<std::string, std::string*> strings = {
      {"--manifest", &out.manifest}, {"--cost", &out.cost}};
  const std::map<std::string, int*> ints = {{"--gtp", &out.gtp},
                                            {"--tp", &out.tp},
                                            {"--dp", &out.dp},
                                            {"--ns_steps", &out.ns_steps}};
  for (size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    const bool has_eq = flag.find('=') != std::string::npos;
    if (has_eq) {
      value = flag.substr(flag.find('=') + 1);
      flag = flag.substr(0, flag.find('='));
    }
    const std::string typed = flag;  // errors quote what the user typed
    flag = SnakeCaseFlag(flag);
    if (flag == "--no_colocate" || flag == "--round_robin") {
      if (has_eq) return flag + " takes no value";
      (flag == "--no_colocate" ? out.colocate : out.round_robin) =
          flag == "--round_robin";
      continue;
    }
    const bool known = strings.count(flag) || ints.count(flag);
    if (!known) return "unknown flag " + typed;
    if (!has_eq) {
      if (i + 1 >= args.size()) return flag + " needs a value";
      value = args[++i];
    }
    if (strings.count(flag)) {
      *strings.at(flag) = value;
    } else if (!absl::SimpleAtoi(value, ints.at(flag))) {
      return flag + " needs an integer, got '" + value + "'";
    }
  }
  if (out.manifest.empty()) return "--manifest FILE is required";
  if (out.gtp == PlanArgs::kUnset) return "--gtp G is required (G >= 1)";
  if (out.tp == PlanArgs::kUnset) return "--tp T is required (T >= 1)";
  if (out.gtp < 1) return "--gtp=" + std::to_string(out.gtp) + " must be >= 1";
  if (out.tp < 1) return "--tp=" + std::to_string(out.tp) + " must be >= 1";
  if (out.dp < 1) return "--dp=" + std::to_string(out.dp) + " must be >= 1";
  if (out.ns_steps < 1) return "--ns_steps must be >= 1";
  if (absl::Status cost = SetOfflineCost(out.cost, "--cost", out.planner);
      !cost.ok()) {
    return std::string(cost.message());
  }
  return "";
}

using Json = nlohmann::ordered_json;

Json PlanJson(const std::string& model, const PlanArgs& a,
              const std::vector<ParamShardSpec>& specs, const HomePlan& plan) {
  Json j;
  j["model"] = model;
  j["domain"] = {{"gtp", a.gtp}, {"tp", a.tp}};
  if (a.dp > 1) j["domain"]["dp"] = a.dp;
  j["cost"] = a.cost;
  j["num_params"] = specs.size();
  int routed = 0;
  for (const ParamShardSpec& s : specs) routed += s.routed();
  j["num_routed"] = routed;
  j["round_robin_fallback"] = plan.round_robin_fallback;
  j["colocated"] = plan.colocated;
  j["max_over_mean"] = plan.max_over_mean;
  j["lower_bound"] = plan.lower_bound;
  j["lower_bound_ratio"] = plan.lower_bound_ratio;
  j["rank_load"] = plan.rank_load;
  Json homes = Json::array();
  for (size_t i = 0; i < specs.size(); ++i) {
    Json home = {{"name", specs[i].name},
                 {"sharding", ParamShardingName(specs[i].sharding)},
                 {"home", {plan.homes[i].g, plan.homes[i].t}}};
    // The home replica, with a DP axis only (plans without one keep their
    // form).
    if (a.dp > 1) home["replica"] = plan.homes[i].d;
    home["full_shape"] = specs[i].full_shape;
    home["local_shape"] = specs[i].local_shape;
    home["pad_length"] = specs[i].pad_length;
    homes.push_back(std::move(home));
  }
  j["homes"] = std::move(homes);
  return j;
}

// One top-level field per line and one home per line: readable and greppable
// for plans of tens of thousands of params.
void PrintPlan(const Json& j, std::ostream& out) {
  out << "{";
  const char* sep = "\n";
  for (const auto& [key, value] : j.items()) {
    out << sep << " " << Json(key).dump() << ": ";
    if (key == "homes") {
      out << "[";
      const char* inner = "\n";
      for (const Json& h : value) {
        out << inner << "  " << h.dump();
        inner = ",\n";
      }
      out << "\n ]";
    } else {
      out << value.dump();
    }
    sep = ",\n";
  }
  out << "\n}\n";
}

}  // namespace

int RunPlan(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err) {
  PlanArgs a;
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h" || arg == "help") {
      out << kUsage;
      return 0;
    }
  }
  if (std::string problem = ParseArgs(args, a); !problem.empty()) {
    err << "muonctl plan: " << problem << "\n" << kUsage;
    return 2;
  }
  absl::StatusOr<Manifest> manifest = LoadManifestFile(a.manifest);
  if (!manifest.ok()) {
    err << "muonctl plan: " << manifest.status().message() << "\n";
    return 1;
  }
  const DomainSize domain{a.gtp, a.tp, a.dp};
  absl::StatusOr<std::vector<ParamShardSpec>> specs =
      ManifestSpecs(*manifest, domain);
  if (!specs.ok()) {
    err << "muonctl plan: " << specs.status().message() << "\n";
    return 1;
  }
  PlannerOptions options = a.planner;
  options.ns_steps = a.ns_steps;
  options.colocate_same_shape = a.colocate;
  HomePlan plan;
  if (a.round_robin) {
    plan = RoundRobinHomes(*specs, domain, options);
  } else {
    absl::StatusOr<HomePlan> planned = PlanNsHomes(*specs, domain, options);
    if (!planned.ok()) {
      err << "muonctl plan: " << planned.status().message() << "\n";
      return 1;
    }
    plan = *std::move(planned);
  }
  PrintPlan(PlanJson(manifest->model, a, *specs, plan), out);
  return 0;
}

}  // namespace muond::muonctl
