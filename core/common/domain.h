#pragma once
// A GTP_remat x TP domain and a rank's place in it (docs/ARCHITECTURE.md
// "Sharding"). The one home of the "domain contains (g, t)" rule: the
// communicator groups (core/comm), the sharding model and plans (core/plan),
// the step engine (core/step) and the servers all check it here.
#include <string>

#include "absl/status/status.h"

namespace muond {

// Sizes of the two axes of a domain, G x T. Both must be >= 1.
struct DomainSize {
  int gtp = 1;
  int tp = 1;
  int ranks() const { return gtp * tp; }
  int FlatRank(int g, int t) const { return g * tp + t; }
  bool Contains(int g, int t) const {
    return g >= 0 && g < gtp && t >= 0 && t < tp;
  }
};

// Sizes >= 1 and (g, t) inside G x T. InvalidArgument "<where>: ..." naming
// the sizes or the coordinates.
absl::Status CheckDomainCoordinates(DomainSize domain, int g, int t,
                                    const std::string& where);

}  // namespace muond
