#pragma once
// torch.optim.Muon's defaults as muond MuonOptions, for benchmarks that
// compare against it or mirror it (bench/gpu/step_bench.py configures both
// sides so): simple coefficients x 5, eps 1e-7, `original` scale, Nesterov,
// momentum 0.95, lr 0.02, decoupled weight decay 0.1, fp32 state.
#include <string>

#include "absl/status/statusor.h"
#include "core/muon/muon_update.h"

namespace muond {

// `precision`: "highest", "high" or "medium" (InvalidArgument otherwise).
inline absl::StatusOr<MuonOptions> TorchMuonDefaults(
    const std::string& precision) {
  MuonOptions o;
  o.lr = 0.02;
  o.momentum = 0.95;
  o.nesterov = true;
  o.weight_decay = 0.1;
  o.weight_decay_method = WeightDecayMethod::kDecoupled;
  o.ns.coefficient_type = CoefficientType::kSimple;
  o.ns.num_steps = 5;
  o.ns.eps = 1e-7f;
  o.scale_mode = ScaleMode::kOriginal;
  o.extra_scale_factor = 1.0;
  absl::StatusOr<MatmulPrecision> p = ParseMatmulPrecision(precision);
  if (!p.ok()) {
    return absl::InvalidArgumentError("--precision: " +
                                      std::string(p.status().message()));
  }
  o.ns.precision = *p;
  return o;
}

}  // namespace muond
