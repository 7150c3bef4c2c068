#pragma once
// A DP x GTP_remat x TP domain and a rank's place in it (docs/ARCHITECTURE.md
// "Sharding"). The one home of the "domain contains (g, t)" rule: the
// communicator groups (core/comm), the sharding model and plans (core/plan),
// the step engine (core/step) and the servers all check it here.
#include <string>

#include "absl/status/status.h"

namespace muond {

// Sizes of the axes of a domain, D x G x T. All must be >= 1. The DP axis
// (D) holds replicas of one G x T grid: rank (d, g, t) holds the same shards
// as (d', g, t). ranks() and FlatRank(g, t) count ONE replica's grid (what the
// exchange plans of a replica use); all_ranks() and FlatRank(d, g, t) the
// whole domain.
struct DomainSize {
  int gtp = 1;
  int tp = 1;
  int dp = 1;
  int ranks() const { return gtp * tp; }
  int all_ranks() const { return dp * gtp * tp; }
  int FlatRank(int g, int t) const { return g * tp + t; }
  int FlatRank(int d, int g, int t) const { return (d * gtp + g) * tp + t; }
  bool Contains(int g, int t) const {
    return g >= 0 && g < gtp && t >= 0 && t < tp;
  }
  bool Contains(int d, int g, int t) const {
    return d >= 0 && d < dp && Contains(g, t);
  }
};

// Sizes >= 1 and (g, t) inside G x T. InvalidArgument "<where>: ..." naming
// the sizes or the coordinates.
absl::Status CheckDomainCoordinates(DomainSize domain, int g, int t,
                                    const std::string& where);
// The same with the DP axis: D >= 1 too, and d inside [0, D).
absl::Status CheckDomainCoordinates(DomainSize domain, int d, int g, int t,
                                    const std::string& where);

}  // namespace muond
