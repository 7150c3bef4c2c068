#include "core/common/domain.h"

#include "absl/strings/str_cat.h"

namespace muond {

absl::Status CheckDomainCoordinates(DomainSize domain, int g, int t,
                                    const std::string& where) {
  if (domain.gtp < 1 || domain.tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": gtp_size ",
                                                   domain.gtp, " and tp_size ",
                                                   domain.tp, " must be >= 1"));
  }
  if (!domain.Contains(g, t)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": (g=", g, ", t=", t,
                                                   ") lies outside ",
                                                   domain.gtp, "x", domain.tp));
  }
  return absl::OkStatus();
}

absl::Status CheckDomainCoordinates(DomainSize domain, int d, int g, int t,
                                    const std::string& where) {
  if (domain.dp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dp_size ", domain.dp, " must be >= 1"));
  }
  if (d < 0 || d >= domain.dp) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": replica d=", d, " lies outside dp_size ", domain.dp));
  }
  return CheckDomainCoordinates(domain, g, t, where);
}

}  // namespace muond
