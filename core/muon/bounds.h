#pragma once
// The bounds every hyperparameter a client sends is checked against, in one
// place: group hyperparameters at registration (MuonOptions / AdamWOptions
// ::Validate) and per-step overrides (core/step) use the same constants, so a
// value refused in a group is refused as an override and the other way round.
//
// Why bounds at all: lr, weight_decay or extra_scale_factor of 1e30 are
// finite doubles, but the fp32 scalars formed from them overflow and every
// later step answers OK on inf params. Real schedules use lr <= 1 and
// weight_decay <= 1; the bounds below leave three orders of magnitude of room
// while keeping lr * shape scale * extra_scale_factor (<= 1e3 * ~1e3 * 1e3)
// far inside fp32. Eps values are used as fp32: they are validated in that
// precision (1e-300 is a positive double but 0 as a float: NaN updates).
#include <string_view>

#include "absl/status/status.h"
#include "core/common/dtype.h"

namespace muond {

inline constexpr double kMaxLr = 1e3;
inline constexpr double kMaxWeightDecay = 1e3;
inline constexpr double kMaxExtraScaleFactor = 1e3;
inline constexpr int kMaxNsSteps = 99;

// `value` finite and in [0, max]. InvalidArgument "<what> must be finite and
// in [0, <max>], got <value>" otherwise.
absl::Status CheckInRange(double value, double max, std::string_view what);
// CheckInRange with kMaxLr / kMaxWeightDecay.
absl::Status CheckLr(double value, std::string_view what);
absl::Status CheckWeightDecay(double value, std::string_view what);

// `value` finite and in [0, 1): Muon's momentum, AdamW's beta1 and beta2 (at
// registration and as step overrides). InvalidArgument "<what> must be in
// [0, 1), got <value>" otherwise.
absl::Status CheckUnitInterval(double value, std::string_view what);

// `value` > 0 and finite once rounded to fp32 (the precision the kernels use
// it in). InvalidArgument "<what> must be > 0 and finite as a float32 (...),
// got <value>" printing the value as given, in double.
absl::Status CheckPositiveFloat32(double value, std::string_view what);

// `dtype` may hold optimizer state (IsStateDType: fp32, bf16 or fp8_e4m3).
// InvalidArgument "<what> must be fp32, bf16 or fp8_e4m3, got <name>"
// otherwise.
absl::Status CheckStateDType(DType dtype, std::string_view what);

}  // namespace muond
