#pragma once
// `muonctl plan --manifest FILE --gtp G --tp T [--cost
// ns_cost|flops|flops_syrk]
//               [--ns_steps N] [--no_colocate] [--round_robin]`
// --gtp and --tp are required. `--help` prints the usage, exit 0.
// Offline: reads a param manifest (core/plan/manifest.h), plans NS homes for a
// G x T domain and prints the plan as JSON: homes, per-rank loads,
// max_over_mean, lower_bound_ratio. Talks to no daemon.
#include <ostream>
#include <string>
#include <vector>

namespace muond::muonctl {

int RunPlan(const std::vector<std::string>& args, std::ostream& out,
            std::ostream& err);

}  // namespace muond::muonctl
