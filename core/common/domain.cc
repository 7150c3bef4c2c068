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

}  // namespace muond
