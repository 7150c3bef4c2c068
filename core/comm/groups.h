#pragma once
// Splits a GTP_remat x TP domain (sizes G x T, docs/ARCHITECTURE.md
// "Sharding") into the two groups a rank (g, t) talks in. Flat rank within the
// domain = g * T + t. Plain ints, so core/comm does not depend on core/plan.
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muond {

struct DomainGroups {
  // Flat domain ranks of the gtp_remat group {(g', t) : g' in [0, G)}, in g'
  // order; this rank is index g in it.
  std::vector<int> gtp_remat_ranks;
  // Flat domain ranks of the tp group {(g, t') : t' in [0, T)}, in t' order;
  // this rank is index t in it.
  std::vector<int> tp_ranks;
  int gtp_remat_rank = 0;  // == g
  int tp_rank = 0;         // == t
  // Store prefixes, unique per group within the domain:
  // "<domain_prefix>/gtp_remat/t<t>" and "<domain_prefix>/tp/g<g>".
  std::string gtp_remat_prefix;
  std::string tp_prefix;
};

// g * T + t.
inline int FlatDomainRank(int g, int t, int tp_size) { return g * tp_size + t; }

// `domain_prefix` should name job, domain and plan version (e.g.
// "job7/dense/v3") so that groups of different domains or of a re-created
// communicator never read each other's keys. Errors: InvalidArgument when a
// size is < 1 or (g, t) lies outside G x T.
absl::StatusOr<DomainGroups> SplitDomain(int gtp_size, int tp_size, int g,
                                         int t,
                                         const std::string& domain_prefix);

}  // namespace muond
