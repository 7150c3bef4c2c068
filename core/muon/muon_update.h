#pragma once
// The per-parameter Muon math around Newton–Schulz: options, the update
// scale, and the three elementwise phases of a step (docs/ARCHITECTURE.md "One
// step"):
//   1. MuonMomentumPhase  buf <- buf + (1-beta)(g - buf) on the local shard;
//                         NS input = nesterov ? g + beta(buf - g) : buf
//   4. NewtonSchulz (newton_schulz.h) on the full matrix: orth (unscaled)
//   6. MuonUpdatePhase    weight decay, then p <- p - adjusted_lr * orth,
//                         adjusted_lr = lr * scale * extra (MuonAdjustedLr)
// MuonStepFullMatrix chains them for one whole matrix on one backend (the
// single-process reference, REPLICATED params, tests and peer oracles).
// Sources: EO (NVIDIA-NeMo/Emerging-Optimizers)
// orthogonalized_optimizers/muon.py and mixin.py, PyTorch's
// torch/optim/_muon.py, and Keller Jordan's Muon post (momentum, Nesterov).
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/common/dtype.h"
#include "core/common/matrix_view.h"
#include "core/common/state_storage.h"
#include "core/muon/bounds.h"
#include "core/muon/muon_variant.h"
#include "core/muon/newton_schulz.h"

namespace muond {

// Update scale modes; rows = dim -2 (size_out), cols = dim -1 (size_in) of
// the FULL matrix (not the local shard):
//   kSpectral      sqrt(max(rows, cols))          EO default; K. Jordan / Kimi
//                                                 arXiv 2502.16982
//   kShapeScaling  sqrt(max(1, rows/cols))        EO; KellerJordan/Muon
//   kUnitRmsNorm   sqrt(rows/cols)                EO; Scion arXiv 2502.07529
//   kOriginal      sqrt(max(1, rows/cols))        torch adjust_lr_fn
//                                                 None/"original"
//   kMatchRmsAdamW 0.2 * sqrt(max(rows, cols))    torch "match_rms_adamw"
//                                                 (Moonlight)
enum class ScaleMode : int32_t {
  kSpectral = 0,
  kShapeScaling = 1,
  kUnitRmsNorm = 2,
  kOriginal = 3,
  kMatchRmsAdamW = 4,
};

// "spectral", "shape_scaling", "unit_rms_norm", "original", "match_rms_adamw".
std::string_view ScaleModeName(ScaleMode mode);
absl::StatusOr<ScaleMode> ParseScaleMode(std::string_view name);
absl::StatusOr<WeightDecayMethod> ParseWeightDecayMethod(std::string_view name);

// The shape factor of `mode` (formulas above), in double. rows, cols >= 1.
double MuonShapeScale(ScaleMode mode, int64_t rows, int64_t cols);
// MuonShapeScale * extra: the total factor, for reporting and plans.
double MuonScaleFactor(ScaleMode mode, int64_t rows, int64_t cols,
                       double extra = 1.0);

struct MuonOptions {
  // Bounds: core/muon/bounds.h (the same for per-step overrides).
  double lr = 3e-4;            // in [0, kMaxLr]
  double momentum = 0.95;      // in [0, 1)
  bool nesterov = false;       // Emerging-Optimizers' default; torch's is true
  double weight_decay = 0.01;  // in [0, kMaxWeightDecay]
  WeightDecayMethod weight_decay_method = WeightDecayMethod::kDecoupled;
  NsOptions ns;  // see newton_schulz.h
  ScaleMode scale_mode = ScaleMode::kSpectral;
  double extra_scale_factor = 1.0;  // in (0, kMaxExtraScaleFactor]
  // Same-shape matrices per NS batch: >= 1, or 0 = auto (by shape:
  // core/step/ns_batch_rule.h). 1 = the bit-exact numerics contract.
  int64_t ns_batch_size = 1;
  // The momentum's dtype (IsStateDType) and residence
  // (core/common/state_storage.h).
  DType state_dtype = DType::kFloat32;
  StateLocation state_location = StateLocation::kDevice;
  // A second momentum buffer (in the state's location and dtype): the
  // momentum phase writes the new momentum there as it reads the old, and the
  // commit swaps the two. Without it the commit recomputes the new momentum
  // in place from the grads (one more read of grad and momentum a step, no
  // second buffer). Bitwise the same either way; host state streamed through
  // device slots is always double-buffered (in host memory).
  bool double_buffer_momentum = false;
  // The second-moment renormalisation after NS (muon_variant.h); beta2 and
  // moment2_eps count only for kNorMuon and kAdaMuon (the anchors' beta2 and
  // eps, defaults included; `ns.eps` is Newton–Schulz's own, torch's eps).
  MuonVariant variant = MuonVariant::kMuon;
  double beta2 = 0.95;        // in [0, 1)
  double moment2_eps = 1e-8;  // > 0 and finite as fp32

  // InvalidArgument naming the field and the rule (backend-independent
  // checks; ValidateNsOptions adds the backend ones).
  absl::Status Validate() const;
  // The variant is known, beta2 in [0, 1), moment2_eps > 0 and finite as
  // fp32.
  absl::Status ValidateVariant() const;

  bool operator==(const MuonOptions&) const = default;
};

// Phase 1. grad fp32|bf16 (trainer memory), momentum in options.state_dtype
// (fp8_e4m3: contiguous, with its block scales, updated in place:
// Backend::MuonMomentum), ns_input fp32|bf16 (a scratch buffer, never the
// state; the step engine uses NsWorkDType(options.ns.precision)). Same
// shapes (any strides: works on the local shard).
absl::Status MuonMomentumPhase(Backend& backend, const MuonOptions& options,
                               const MatrixView& grad,
                               const MatrixView& momentum,
                               const MatrixView& ns_input,
                               float* momentum_scales = nullptr);

// Phase 1 for n params at once (same-length spans; bitwise the n single
// calls, fewer launches on CUDA): momenta_in[i] is read and the new momentum
// written to momenta_out[i], which is momenta_in[i] (in place) or a buffer
// of its own (the step engine's staged momentum: no copy of the state).
// scales: fp8_e4m3 state's block scales, one per param (empty otherwise).
// With `check` the grads are also checked against its limit as they are read
// (Backend::CheckedMuonMomentumBatch; the finding is TakeGradChecks' of its
// slot).
struct MomentumGradCheck {
  float limit = 0.0f;
  int slot = 0;
};
absl::Status MuonMomentumPhaseBatch(
    Backend& backend, const MuonOptions& options,
    absl::Span<const MatrixView> grads, absl::Span<const MatrixView> momenta_in,
    absl::Span<const MatrixView> momenta_out,
    absl::Span<const MatrixView> ns_inputs,
    absl::Span<const BlockScales> scales = {},
    std::optional<MomentumGradCheck> check = std::nullopt);
// In place.
absl::Status MuonMomentumPhaseBatch(Backend& backend,
                                    const MuonOptions& options,
                                    absl::Span<const MatrixView> grads,
                                    absl::Span<const MatrixView> momenta,
                                    absl::Span<const MatrixView> ns_inputs);

// The lr an update of a full_rows x full_cols matrix applies to the
// unscaled Newton–Schulz output: lr * MuonShapeScale * extra_scale_factor,
// formed in double and rounded once to fp32, as torch.optim.Muon forms
// adjusted_lr = lr * scale and adds update * -adjusted_lr. (Scaling the
// update instead, (orth * scale) * extra as EO does, is the same math with
// one more rounding and a pass over the NS output; applying it here keeps
// the output in the bf16 workspace.) Errors: full_rows or full_cols < 1.
absl::StatusOr<float> MuonAdjustedLr(const MuonOptions& options,
                                     int64_t full_rows, int64_t full_cols);

// Phase 6. param fp32|bf16 (updated in place, one rounding), update (the
// unscaled NS output) fp32|bf16|fp16, adjusted_lr from MuonAdjustedLr. The
// weight decay uses the base lr (decoupled: p <- p - lr*wd*p).
absl::Status MuonUpdatePhase(Backend& backend, const MuonOptions& options,
                             const MatrixView& param, const MatrixView& update,
                             float adjusted_lr);

// Phase 6 for n params at once (bitwise the n single calls). With
// row_factors (one fp32 rows x 1 per param: NorMuon's), each update row is
// scaled by its factor as it is applied (Backend::ApplyRowScaledUpdateBatch).
absl::Status MuonUpdatePhaseBatch(
    Backend& backend, const MuonOptions& options,
    absl::Span<const MatrixView> params, absl::Span<const MatrixView> updates,
    absl::Span<const float> adjusted_lrs,
    absl::Span<const MatrixView> row_factors = {});

// A whole Muon step of one full matrix: momentum -> NS (in place in
// `scratch`, rows x cols, fp32 or bf16; the step engine's dtype is
// NsWorkDType; the result over it as NsResultOver gives it) -> weight decay +
// update with MuonAdjustedLr. `ns` must have been created for the param's
// shape with options.ns.
absl::Status MuonStepFullMatrix(Backend& backend, const MuonOptions& options,
                                NewtonSchulz& ns, const MatrixView& param,
                                const MatrixView& grad,
                                const MatrixView& momentum,
                                const MatrixView& scratch);

// The variant's renormalisation of one whole matrix's unscaled NS output
// `update` (muon_variant.h; nothing for kMuon), its state `moment2` (fp32:
// rows x 1 for NorMuon, the matrix's shape for AdaMuon) updated in place.
// AdaMuon rewrites `update`; NorMuon leaves it and writes its row factors to
// NorMuonFactorsOf(row_scratch), which the update applies
// (MuonUpdatePhaseBatch with row_factors). `row_scratch`: contiguous fp32
// rows x 3 backend memory (NorMuon). Synchronises.
absl::Status MuonVariantFullMatrix(Backend& backend, const MuonOptions& options,
                                   const MatrixView& update,
                                   const MatrixView& moment2,
                                   const MatrixView& row_scratch);

// NorMuon's row factors in MuonVariantFullMatrix's row_scratch (rows x 1).
MatrixView NorMuonFactorsOf(const MatrixView& row_scratch, int64_t rows);

// MuonStepFullMatrix with the variant between NS and the update (the
// single-process path of NorMuon / AdaMuon).
absl::Status MuonStepFullMatrix(Backend& backend, const MuonOptions& options,
                                NewtonSchulz& ns, const MatrixView& param,
                                const MatrixView& grad,
                                const MatrixView& momentum,
                                const MatrixView& scratch,
                                const MatrixView& moment2,
                                const MatrixView& row_scratch);

}  // namespace muond
