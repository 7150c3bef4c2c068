#include "core/comm/groups.h"

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {

absl::StatusOr<DomainGroups> SplitDomain(DomainSize domain, int d, int g, int t,
                                         const std::string& domain_prefix) {
  RETURN_IF_ERROR(
      CheckDomainCoordinates(domain, d, g, t, "domain " + domain_prefix));
  DomainGroups groups;
  for (int other_g = 0; other_g < domain.gtp; ++other_g) {
    groups.gtp_remat_ranks.push_back(domain.FlatRank(d, other_g, t));
  }
  for (int other_t = 0; other_t < domain.tp; ++other_t) {
    groups.tp_ranks.push_back(domain.FlatRank(d, g, other_t));
  }
  for (int other_d = 0; other_d < domain.dp; ++other_d) {
    groups.dp_ranks.push_back(domain.FlatRank(other_d, g, t));
  }
  groups.gtp_remat_rank = g;
  groups.tp_rank = t;
  groups.dp_rank = d;
  // With D = 1 the prefixes are those of a domain without a DP axis.
  const std::string replica =
      domain.dp > 1 ? absl::StrCat(domain_prefix, "/d", d) : domain_prefix;
  groups.gtp_remat_prefix = absl::StrCat(replica, "/gtp_remat/t", t);
  groups.tp_prefix = absl::StrCat(replica, "/tp/g", g);
  groups.dp_prefix = absl::StrCat(domain_prefix, "/dp/g", g, "/t", t);
  return groups;
}

absl::StatusOr<DomainGroups> SplitDomain(int gtp_size, int tp_size, int g,
                                         int t,
                                         const std::string& domain_prefix) {
  return SplitDomain(DomainSize{gtp_size, tp_size, 1}, 0, g, t, domain_prefix);
}

}  // namespace muond
