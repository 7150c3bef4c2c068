#include "core/muon/bounds.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/common/state_storage.h"

namespace muond {

absl::Status CheckInRange(double value, double max, std::string_view what) {
  if (!std::isfinite(value) || value < 0.0 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), " must be finite and in [0, ", max,
                     "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckLr(double value, std::string_view what) {
  return CheckInRange(value, kMaxLr, what);
}

absl::Status CheckWeightDecay(double value, std::string_view what) {
  return CheckInRange(value, kMaxWeightDecay, what);
}

absl::Status CheckUnitInterval(double value, std::string_view what) {
  if (!std::isfinite(value) || value < 0.0 || value >= 1.0) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), " must be in [0, 1), got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckPositiveFloat32(double value, std::string_view what) {
  const float as_float = static_cast<float>(value);
  if (!std::isfinite(value) || !std::isfinite(as_float) || !(as_float > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), " must be > 0 and finite as a float32 (in [",
        std::numeric_limits<float>::denorm_min(), ", ",
        std::numeric_limits<float>::max(), "]), got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckStateDType(DType dtype, std::string_view what) {
  if (IsStateDType(dtype)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(what), " must be fp32, bf16 or fp8_e4m3, got ",
                   std::string(DTypeName(dtype))));
}

}  // namespace muond
