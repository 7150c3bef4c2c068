#include "core/comm/groups.h"

#include "absl/strings/str_cat.h"
#include "core/common/domain.h"
#include "core/common/status_macros.h"

namespace muond {

absl::StatusOr<DomainGroups> SplitDomain(int gtp_size, int tp_size, int g,
                                         int t,
                                         const std::string& domain_prefix) {
  RETURN_IF_ERROR(CheckDomainCoordinates(DomainSize{gtp_size, tp_size}, g, t,
                                         "domain " + domain_prefix));
  DomainGroups groups;
  for (int other_g = 0; other_g < gtp_size; ++other_g) {
    groups.gtp_remat_ranks.push_back(FlatDomainRank(other_g, t, tp_size));
  }
  for (int other_t = 0; other_t < tp_size; ++other_t) {
    groups.tp_ranks.push_back(FlatDomainRank(g, other_t, tp_size));
  }
  groups.gtp_remat_rank = g;
  groups.tp_rank = t;
  groups.gtp_remat_prefix = absl::StrCat(domain_prefix, "/gtp_remat/t", t);
  groups.tp_prefix = absl::StrCat(domain_prefix, "/tp/g", g);
  return groups;
}

}  // namespace muond
