#pragma once
// AdamW for params of `algorithm: adamw` groups (1-D tensors, embeddings,
// heads): one fused elementwise kernel per tensor, same math and operation
// order as torch.optim.AdamW's single-tensor path (torch/optim/adamw.py ->
// adam.py _single_tensor_adam with decoupled weight decay):
//   p *= 1 - lr*wd
//   m  = lerp(m, g, 1 - beta1)
//   v  = v*beta2 + (1 - beta2)*g*g
//   p += -(lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// (without bias correction both corrections are 1).
#include <cstdint>

#include "absl/status/status.h"
#include "core/backend/backend.h"
#include "core/common/matrix_view.h"
#include "core/common/state_storage.h"
#include "core/muon/bounds.h"

namespace muond {

struct AdamWOptions {
  // Bounds: core/muon/bounds.h (the same for per-step overrides).
  double lr = 1e-3;            // in [0, kMaxLr]
  double beta1 = 0.9;          // in [0, 1)
  double beta2 = 0.999;        // in [0, 1)
  double eps = 1e-8;           // > 0 and finite as a float32
  double weight_decay = 0.01;  // in [0, kMaxWeightDecay]
  bool bias_correction = true;
  // exp_avg and exp_avg_sq's dtype (IsStateDType; computed in fp32 and
  // stored as bf16 rounded to nearest even, as torch keeps a bf16 param's
  // moments, or as blockwise-scaled fp8: Backend::AdamW) and residence
  // (core/common/state_storage.h).
  DType state_dtype = DType::kFloat32;
  StateLocation state_location = StateLocation::kDevice;

  // InvalidArgument naming the field and the rule.
  absl::Status Validate() const;
};

// The fp32 scalars of step `step` (1-based), computed in double.
AdamWScalars MakeAdamWScalars(const AdamWOptions& options, int64_t step);

// One AdamW step at step number `step` >= 1. param fp32|bf16, grad
// fp32|bf16, exp_avg/exp_avg_sq in options.state_dtype (zero before step 1;
// fp8_e4m3: with their block scales), all same shape.
absl::Status AdamWStep(Backend& backend, const AdamWOptions& options,
                       int64_t step, const MatrixView& param,
                       const MatrixView& grad, const MatrixView& exp_avg,
                       const MatrixView& exp_avg_sq,
                       const AdamWMomentScales& scales = {});

}  // namespace muond
