#include "core/muon/adamw.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "core/muon/bounds.h"

namespace muond {
absl::Status AdamWOptions::Validate() const {
  RETURN_IF_ERROR(CheckLr(lr, "adamw lr"));
  RETURN_IF_ERROR(CheckUnitInterval(beta1, "adamw beta1"));
  RETURN_IF_ERROR(CheckUnitInterval(beta2, "adamw beta2"));
  // The kernel adds eps in fp32 (MakeAdamWScalars): 1e-300 would be 0 there.
  RETURN_IF_ERROR(CheckPositiveFloat32(eps, "adamw eps"));
  RETURN_IF_ERROR(CheckWeightDecay(weight_decay, "adamw weight_decay"));
  return CheckStateDType(state_dtype, "adamw state_dtype");
}

AdamWScalars MakeAdamWScalars(const AdamWOptions& o, int64_t step) {
  const double t = double(step);
  const double bc1 = o.bias_correction ? 1.0 - std::pow(o.beta1, t) : 1.0;
  const double bc2 = o.bias_correction ? 1.0 - std::pow(o.beta2, t) : 1.0;
  AdamWScalars s;
  s.param_decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  s.one_minus_beta1 = static_cast<float>(1.0 - o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - o.beta2);
  s.step_size = static_cast<float>(o.lr / bc1);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(o.eps);
  return s;
}

absl::Status AdamWStep(Backend& backend, const AdamWOptions& options,
                       int64_t step, const MatrixView& param,
                       const MatrixView& grad, const MatrixView& exp_avg,
                       const MatrixView& exp_avg_sq,
                       const AdamWMomentScales& scales) {
  RETURN_IF_ERROR(options.Validate());
  if (step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("adamw step must be >= 1, got ", step));
  }
  for (const MatrixView* moment : {&exp_avg, &exp_avg_sq}) {
    if (moment->dtype != options.state_dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("adamw: exp_avg and exp_avg_sq must be the state_dtype ",
                       std::string(DTypeName(options.state_dtype)), ", got ",
                       std::string(DTypeName(moment->dtype))));
    }
  }
  return backend.AdamW(param, grad, exp_avg, exp_avg_sq,
                       MakeAdamWScalars(options, step), scales);
}

}  // namespace muond
