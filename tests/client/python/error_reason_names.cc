// Prints core/common/error_reason.h's reason names, one a line, for
// test_error_reason.py (the Python client repeats them).
#include <cstdio>
#include <string>

#include "core/common/error_reason.h"

int main() {
  const absl::string_view unspecified =
      muond::ErrorReasonName(muond::ErrorReason::kUnspecified);
  // Enumerators are dense from 1; an unknown value names "unspecified".
  for (int i = 1;; ++i) {
    const absl::string_view name =
        muond::ErrorReasonName(static_cast<muond::ErrorReason>(i));
    if (name == unspecified) break;
    std::printf("%s\n", std::string(name).c_str());
  }
  return 0;
}
