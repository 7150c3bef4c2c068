#include "core/muon/muon_update.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "core/muon/bounds.h"

namespace muond {

std::string_view ScaleModeName(ScaleMode mode) {
  switch (mode) {
    case ScaleMode::kSpectral:
      return "spectral";
    case ScaleMode::kShapeScaling:
      return "shape_scaling";
    case ScaleMode::kUnitRmsNorm:
      return "unit_rms_norm";
    case ScaleMode::kOriginal:
      return "original";
    case ScaleMode::kMatchRmsAdamW:
      return "match_rms_adamw";
  }
  return "unknown";
}

absl::StatusOr<ScaleMode> ParseScaleMode(std::string_view name) {
  for (ScaleMode m :
       {ScaleMode::kSpectral, ScaleMode::kShapeScaling, ScaleMode::kUnitRmsNorm,
        ScaleMode::kOriginal, ScaleMode::kMatchRmsAdamW}) {
    if (ScaleModeName(m) == name) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "scale_mode: unknown name '", std::string(name),
      "'; expected spectral, shape_scaling, unit_rms_norm, original or "
      "match_rms_adamw"));
}

absl::StatusOr<WeightDecayMethod> ParseWeightDecayMethod(
    std::string_view name) {
  for (WeightDecayMethod m :
       {WeightDecayMethod::kDecoupled, WeightDecayMethod::kIndependent,
        WeightDecayMethod::kCautious, WeightDecayMethod::kNone}) {
    if (WeightDecayMethodName(m) == name) return m;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("weight_decay_method: unknown name '", std::string(name),
                   "'; expected decoupled, independent, cautious or none"));
}

double MuonShapeScale(ScaleMode mode, int64_t rows, int64_t cols) {
  const double r = double(rows), c = double(cols);
  switch (mode) {
    case ScaleMode::kSpectral:
      return std::sqrt(std::max(r, c));
    case ScaleMode::kShapeScaling:
    case ScaleMode::kOriginal:
      return std::sqrt(std::max(1.0, r / c));
    case ScaleMode::kUnitRmsNorm:
      return std::sqrt(r / c);
    case ScaleMode::kMatchRmsAdamW:
      return 0.2 * std::sqrt(std::max(r, c));
  }
  return 1.0;
}

double MuonScaleFactor(ScaleMode mode, int64_t rows, int64_t cols,
                       double extra) {
  return MuonShapeScale(mode, rows, cols) * extra;
}

absl::Status MuonOptions::Validate() const {
  RETURN_IF_ERROR(CheckLr(lr, "muon lr"));
  RETURN_IF_ERROR(CheckUnitInterval(momentum, "muon momentum"));
  RETURN_IF_ERROR(CheckWeightDecay(weight_decay, "muon weight_decay"));
  // 0 would apply no update at all (Megatron refuses it too): a mistake.
  if (!std::isfinite(extra_scale_factor) || extra_scale_factor <= 0.0 ||
      extra_scale_factor > kMaxExtraScaleFactor) {
    return absl::InvalidArgumentError(
        absl::StrCat("muon extra_scale_factor must be finite and in (0, ",
                     kMaxExtraScaleFactor, "], got ", extra_scale_factor));
  }
  if (ns_batch_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "muon ns_batch_size must be >= 1, or 0 for auto, got ", ns_batch_size));
  }
  if (ns.num_steps < 1 || ns.num_steps > kMaxNsSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("muon ns.num_steps must be in [1, ", kMaxNsSteps,
                     "], got ", ns.num_steps));
  }
  RETURN_IF_ERROR(CheckPositiveFloat32(ns.eps, "muon ns.eps"));
  if (ns.syrk_block_rows < 0 || ns.syrk_block_rows > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "muon ns.syrk_block_rows must be in [0, 16] (0 = auto), got ",
        ns.syrk_block_rows));
  }
  RETURN_IF_ERROR(CheckStateDType(state_dtype, "muon state_dtype"));
  RETURN_IF_ERROR(ValidateVariant());
  RETURN_IF_ERROR(ValidateGramOptions(ns));
  return CoefficientSchedule(ns.coefficient_type, ns.custom, ns.num_steps)
      .status();
}

absl::Status MuonOptions::ValidateVariant() const {
  if (MuonVariantName(variant) == "unknown") {
    return absl::InvalidArgumentError(
        absl::StrCat("muon variant must be muon, normuon or adamuon, got ",
                     static_cast<int>(variant)));
  }
  RETURN_IF_ERROR(CheckUnitInterval(beta2, "muon beta2"));
  // AdaMuon's normalised update O / (sqrt(v) + eps) reaches 1 / sqrt(1 -
  // beta2) (v from zero) and is written back over Gram NS's fp16 result
  // (NsResultDType): 2^-30 keeps it within 2^15 < 65504.
  constexpr double kAdaMuonMinOneMinusBeta2 = 1.0 / double(1 << 30);
  if (variant == MuonVariant::kAdaMuon &&
      1.0 - beta2 < kAdaMuonMinOneMinusBeta2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "muon beta2 must be at most 1 - 2^-30 with variant adamuon, got ",
        beta2,
        ": its normalised update reaches 1/sqrt(1 - beta2), which must fit "
        "fp16 (Gram NS's result, which the update is written over)"));
  }
  return CheckPositiveFloat32(moment2_eps, "muon moment2_eps");
}

namespace {
absl::Status CheckMomentumDType(const MuonOptions& options,
                                const MatrixView& momentum) {
  if (momentum.dtype == options.state_dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("momentum: dtype must be the state_dtype ",
                   std::string(DTypeName(options.state_dtype)), ", got ",
                   std::string(DTypeName(momentum.dtype))));
}
}  // namespace

absl::Status MuonMomentumPhase(Backend& backend, const MuonOptions& options,
                               const MatrixView& grad,
                               const MatrixView& momentum,
                               const MatrixView& ns_input,
                               float* momentum_scales) {
  RETURN_IF_ERROR(CheckMomentumDType(options, momentum));
  return backend.MuonMomentum(grad, momentum, momentum, options.momentum,
                              options.nesterov, ns_input,
                              BlockScales{momentum_scales, momentum_scales});
}

absl::Status MuonMomentumPhaseBatch(Backend& backend,
                                    const MuonOptions& options,
                                    absl::Span<const MatrixView> grads,
                                    absl::Span<const MatrixView> momenta_in,
                                    absl::Span<const MatrixView> momenta_out,
                                    absl::Span<const MatrixView> ns_inputs,
                                    absl::Span<const BlockScales> scales,
                                    std::optional<MomentumGradCheck> check) {
  for (absl::Span<const MatrixView> momenta : {momenta_in, momenta_out}) {
    for (const MatrixView& momentum : momenta) {
      RETURN_IF_ERROR(CheckMomentumDType(options, momentum));
    }
  }
  if (check.has_value()) {
    return backend.CheckedMuonMomentumBatch(
        grads, momenta_in, momenta_out, options.momentum, options.nesterov,
        ns_inputs, scales, check->limit, check->slot);
  }
  return backend.MuonMomentumBatch(grads, momenta_in, momenta_out,
                                   options.momentum, options.nesterov,
                                   ns_inputs, scales);
}

absl::Status MuonMomentumPhaseBatch(Backend& backend,
                                    const MuonOptions& options,
                                    absl::Span<const MatrixView> grads,
                                    absl::Span<const MatrixView> momenta,
                                    absl::Span<const MatrixView> ns_inputs) {
  return MuonMomentumPhaseBatch(backend, options, grads, momenta, momenta,
                                ns_inputs);
}

absl::StatusOr<float> MuonAdjustedLr(const MuonOptions& options,
                                     int64_t full_rows, int64_t full_cols) {
  if (full_rows < 1 || full_cols < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale: full_rows and full_cols must be >= 1, got ",
                     full_rows, "x", full_cols));
  }
  return static_cast<float>(
      options.lr * MuonScaleFactor(options.scale_mode, full_rows, full_cols,
                                   options.extra_scale_factor));
}

namespace {

// The decay factor ApplyUpdate takes, formed in double and rounded once (as
// Python floats reach torch kernels): decoupled/cautious lr*wd (base lr),
// independent wd; kNone when weight_decay is 0.
std::pair<float, WeightDecayMethod> DecayOf(const MuonOptions& options) {
  const double decay =
      options.weight_decay_method == WeightDecayMethod::kIndependent
          ? options.weight_decay
          : options.lr * options.weight_decay;
  return {static_cast<float>(decay), options.weight_decay == 0.0
                                         ? WeightDecayMethod::kNone
                                         : options.weight_decay_method};
}

}  // namespace

absl::Status MuonUpdatePhase(Backend& backend, const MuonOptions& options,
                             const MatrixView& param, const MatrixView& update,
                             float adjusted_lr) {
  const auto [decay, method] = DecayOf(options);
  return backend.ApplyUpdate(param, update, adjusted_lr, decay, method);
}

absl::Status MuonUpdatePhaseBatch(Backend& backend, const MuonOptions& options,
                                  absl::Span<const MatrixView> params,
                                  absl::Span<const MatrixView> updates,
                                  absl::Span<const float> adjusted_lrs,
                                  absl::Span<const MatrixView> row_factors) {
  const auto [decay, method] = DecayOf(options);
  if (row_factors.empty()) {
    return backend.ApplyUpdateBatch(params, updates, adjusted_lrs, decay,
                                    method);
  }
  return backend.ApplyRowScaledUpdateBatch(params, updates, row_factors,
                                           adjusted_lrs, decay, method);
}

MatrixView NorMuonFactorsOf(const MatrixView& row_scratch, int64_t rows) {
  return ContiguousView(static_cast<float*>(row_scratch.data) + 2 * rows,
                        DType::kFloat32, rows, 1);
}

absl::Status MuonStepFullMatrix(Backend& backend, const MuonOptions& options,
                                NewtonSchulz& ns, const MatrixView& param,
                                const MatrixView& grad,
                                const MatrixView& momentum,
                                const MatrixView& scratch) {
  if (options.variant != MuonVariant::kMuon) {
    return absl::InvalidArgumentError(
        "muon step: a variant needs its state: call the overload with moment2 "
        "and row_scratch");
  }
  return MuonStepFullMatrix(backend, options, ns, param, grad, momentum,
                            scratch, MatrixView{}, MatrixView{});
}

absl::Status MuonVariantFullMatrix(Backend& backend, const MuonOptions& options,
                                   const MatrixView& update,
                                   const MatrixView& moment2,
                                   const MatrixView& row_scratch) {
  if (options.variant == MuonVariant::kAdaMuon) {
    RETURN_IF_ERROR(
        backend.AdaMuonNormalize(update, moment2, moment2, options.beta2,
                                 static_cast<float>(options.moment2_eps)));
    return backend.Synchronize();
  }
  if (options.variant != MuonVariant::kNorMuon) return absl::OkStatus();
  // The whole matrix is one row block of a set: this rank holds every row,
  // its sums and its state (row_scratch: stats = 2 x rows, then factors).
  // The update is left as it is: MuonStepFullMatrix applies the factors.
  const int64_t rows = update.rows;
  if (row_scratch.dtype != DType::kFloat32 || !row_scratch.contiguous() ||
      row_scratch.numel() < 3 * rows) {
    return absl::InvalidArgumentError(absl::StrCat(
        "normuon: row_scratch must be contiguous fp32 of ", 3 * rows,
        " elements (rows x 3), got ", row_scratch.rows, "x", row_scratch.cols));
  }
  float* scratch = static_cast<float*>(row_scratch.data);
  const MatrixView stats =
      ContiguousView(scratch, DType::kFloat32, 2 * rows, 1);
  const NorMuonRowBlock block{.update = update,
                              .full_rows = rows,
                              .full_cols = update.cols,
                              .valid = rows,
                              .adds_sums = true,
                              .speaks_state = true};
  RETURN_IF_ERROR(backend.NorMuonRowStats({block}, moment2, stats));
  RETURN_IF_ERROR(backend.NorMuonFactors({block}, stats, moment2, moment2,
                                         NorMuonFactorsOf(row_scratch, rows),
                                         options.beta2, options.moment2_eps));
  return backend.Synchronize();
}

absl::Status MuonStepFullMatrix(Backend& backend, const MuonOptions& options,
                                NewtonSchulz& ns, const MatrixView& param,
                                const MatrixView& grad,
                                const MatrixView& momentum,
                                const MatrixView& scratch,
                                const MatrixView& moment2,
                                const MatrixView& row_scratch) {
  if (ns.rows() != param.rows || ns.cols() != param.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("muon step: NewtonSchulz is for ", ns.rows(), "x",
                     ns.cols(), ", param is ", param.rows, "x", param.cols));
  }
  ASSIGN_OR_RETURN(const float adjusted_lr,
                   MuonAdjustedLr(options, param.rows, param.cols));
  RETURN_IF_ERROR(MuonMomentumPhase(backend, options, grad, momentum, scratch));
  // The update is read in the dtype NS writes it in (as the step engine's).
  const MatrixView update = NsResultOver(scratch, ns.result_dtype());
  RETURN_IF_ERROR(ns.Run(scratch, update, 1));
  RETURN_IF_ERROR(
      MuonVariantFullMatrix(backend, options, update, moment2, row_scratch));
  if (options.variant != MuonVariant::kNorMuon) {
    return MuonUpdatePhase(backend, options, param, update, adjusted_lr);
  }
  return MuonUpdatePhaseBatch(backend, options, {param}, {update},
                              {adjusted_lr},
                              {NorMuonFactorsOf(row_scratch, param.rows)});
}

}  // namespace muond
