#pragma once
// Splits a DP x GTP_remat x TP domain (sizes D x G x T, docs/ARCHITECTURE.md
// "Sharding") into the three groups a rank (d, g, t) talks in. Flat rank
// within the domain = (d * G + g) * T + t (DomainSize::FlatRank). Plain ints
// and core/common's DomainSize, so core/comm does not depend on core/plan.
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/domain.h"

namespace muond {

struct DomainGroups {
  // Flat domain ranks of the gtp_remat group {(d, g', t) : g' in [0, G)}, in
  // g' order; this rank is index g in it.
  std::vector<int> gtp_remat_ranks;
  // Flat domain ranks of the tp group {(d, g, t') : t' in [0, T)}, in t'
  // order; this rank is index t in it.
  std::vector<int> tp_ranks;
  // Flat domain ranks of the dp group {(d', g, t) : d' in [0, D)}, in d'
  // order: the ranks holding the same shards as this one. This rank is
  // index d in it.
  std::vector<int> dp_ranks;
  int gtp_remat_rank = 0;  // == g
  int tp_rank = 0;         // == t
  int dp_rank = 0;         // == d
  // Store prefixes, unique per group within the domain. The gtp_remat and tp
  // groups are per replica, so replica d's never meet replica d''s:
  // "<domain_prefix>/gtp_remat/t<t>" and "<domain_prefix>/tp/g<g>" with
  // D = 1 (as before the DP axis), "<domain_prefix>/d<d>/gtp_remat/t<t>" and
  // "<domain_prefix>/d<d>/tp/g<g>" with D > 1; the dp group's is
  // "<domain_prefix>/dp/g<g>/t<t>".
  std::string gtp_remat_prefix;
  std::string tp_prefix;
  std::string dp_prefix;
};

// g * T + t: the flat rank within one replica's G x T grid.
inline int FlatDomainRank(int g, int t, int tp_size) { return g * tp_size + t; }

// `domain_prefix` should name job, domain and plan version (e.g.
// "job7/dense/v3") so that groups of different domains or of a re-created
// communicator never read each other's keys. Errors: InvalidArgument when a
// size is < 1 or (d, g, t) lies outside D x G x T.
absl::StatusOr<DomainGroups> SplitDomain(DomainSize domain, int d, int g, int t,
                                         const std::string& domain_prefix);

// One replica (D = 1): SplitDomain({gtp_size, tp_size, 1}, 0, g, t, ...).
absl::StatusOr<DomainGroups> SplitDomain(int gtp_size, int tp_size, int g,
                                         int t,
                                         const std::string& domain_prefix);

}  // namespace muond
