#pragma once
// Newton–Schulz coefficient sets (a, b, c) for the step
//   A = X X^T;  B = b*A + c*A^2;  X <- a*X + B*X       (c == 0: X <- a*X +
//   b*A*X)
// Source: NVIDIA-NeMo/Emerging-Optimizers
// emerging_optimizers/orthogonalized_optimizers/muon_utils.py
// (_COEFFICIENT_SETS; "values rounded to closest representable in single
// precision"; Emerging-Optimizers 0.3.0 on PyPI):
//   simple         KellerJordan/Muon, torch.optim.Muon; 1 tuple, cycle
//   quintic        leloykun / modded-nanogpt; 5 tuples, cycle (default)
//   polar_express  arXiv 2505.16932, 1.01^degree safety factor included;
//                  8 tuples, repeat last
//   aol            thib-s/flash-newton-schulz; 4 tuples, cycle
//   cans           arXiv 2506.10935; 5 tuples, repeat last
//   deepseekv4     DeepSeek-V4 report; simple x 8 then (2, -1.5, 0.5) x 2,
//                  repeat last
//   custom         a user list, cycle
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/dtype.h"

namespace muond {

enum class CoefficientType : int32_t {
  kSimple = 0,
  kQuintic = 1,
  kPolarExpress = 2,
  kAol = 3,
  kCans = 4,
  kDeepseekV4 = 5,
  kCustom = 6,
};

struct NsCoefficients {
  float a = 0.0f;
  float b = 0.0f;
  float c = 0.0f;

  bool operator==(const NsCoefficients&) const = default;
};

enum class CoefficientIterMode : int32_t { kCycle = 0, kRepeatLast = 1 };

// "simple", "quintic", "polar_express", "aol", "cans", "deepseekv4", "custom".
std::string_view CoefficientTypeName(CoefficientType type);
// Inverse of CoefficientTypeName; InvalidArgument listing the names.
absl::StatusOr<CoefficientType> ParseCoefficientType(std::string_view name);

// The built-in tuples of `type` (empty for kCustom).
const std::vector<NsCoefficients>& BuiltinCoefficients(CoefficientType type);
// How a set iterates past its end (EO: repeat_last for polar_express, cans,
// deepseekv4; cycle otherwise).
CoefficientIterMode IterModeOf(CoefficientType type);

// The (a, b, c) used at each of `num_steps` steps. InvalidArgument when
// num_steps < 1, when kCustom has an empty `custom` list or a non-finite
// value, or when `custom` is given for a built-in type.
absl::StatusOr<std::vector<NsCoefficients>> CoefficientSchedule(
    CoefficientType type, const std::vector<NsCoefficients>& custom,
    int num_steps);

// The default Gram Newton–Schulz restart iterations (each in [1, num_steps),
// ascending) for a coefficient set run for `num_steps` steps with Gram
// products in `iteration_dtype` (GramIterationDType: kFloat16 or kBFloat16
// under kMedium, kFloat32 under kHighest/kHigh): for the built-in sets with
// num_steps <= kGramRestartTableSteps the committed table computed by
// tools/gram_restart_tuner.py (the fewest restarts whose placement keeps the
// peer's cond(Q) score below 1e8 and the emulated output's sigma_max within
// the NS polynomial's maximum + 0.05 in that dtype; bf16 rounds 8x coarser
// than fp16 and often needs one restart more); otherwise (kCustom, longer
// schedules) the fallback every other iteration from 2, {2, 4, 6, ...}, or
// {1} for num_steps == 2 and {} for 1 (no coefficient-specific analysis
// exists for those, so the fallback restarts about as often as the busiest
// tuned rows: a restart costs two n x m GEMMs but re-forms R from X, as
// standard NS does every step).
inline constexpr int kGramRestartTableSteps = 10;
std::vector<int> DefaultGramRestarts(CoefficientType type, int num_steps,
                                     DType iteration_dtype);

}  // namespace muond
