#include "core/backend/backend.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/common/state_storage.h"
#include "core/common/status_macros.h"

namespace muond {

absl::Status Backend::MuonMomentumBatch(
    absl::Span<const MatrixView> grads, absl::Span<const MatrixView> momenta_in,
    absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
    absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales) {
  RETURN_IF_ERROR(
      CheckMomentumBatch(grads, momenta_in, momenta_out, outs, scales));
  for (size_t i = 0; i < grads.size(); ++i) {
    RETURN_IF_ERROR(MuonMomentum(grads[i], momenta_in[i], momenta_out[i], beta,
                                 nesterov, outs[i],
                                 scales.empty() ? BlockScales{} : scales[i]));
  }
  return absl::OkStatus();
}

absl::Status Backend::CheckedMuonMomentumBatch(
    absl::Span<const MatrixView> grads, absl::Span<const MatrixView> momenta_in,
    absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
    absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales,
    float grad_limit, int slot) {
  RETURN_IF_ERROR(CheckGradsInto(grads, grad_limit, slot));
  return MuonMomentumBatch(grads, momenta_in, momenta_out, beta, nesterov, outs,
                           scales);
}

absl::Status Backend::CheckGradsInto(absl::Span<const MatrixView> views,
                                     float limit, int slot) {
  RETURN_IF_ERROR(CheckGradCheckSlot(slot, grad_check_slots()));
  if (views.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const bool within, AllFiniteBelow(views, limit));
  if (checked_grads_out_of_range_.size() <= size_t(slot)) {
    checked_grads_out_of_range_.resize(slot + 1, false);
  }
  if (!within) checked_grads_out_of_range_[slot] = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<bool>> Backend::TakeGradChecks(int slots) {
  RETURN_IF_ERROR(CheckGradCheckSlots(slots, grad_check_slots()));
  std::vector<bool> within(slots, true);
  for (int k = 0; k < slots && size_t(k) < checked_grads_out_of_range_.size();
       ++k) {
    within[k] = !checked_grads_out_of_range_[k];
    checked_grads_out_of_range_[k] = false;
  }
  return within;
}

absl::Status Backend::ApplyUpdateBatch(absl::Span<const MatrixView> params,
                                       absl::Span<const MatrixView> updates,
                                       absl::Span<const float> lrs, float decay,
                                       WeightDecayMethod method) {
  RETURN_IF_ERROR(CheckUpdateBatch(params, updates, lrs));
  for (size_t i = 0; i < params.size(); ++i)
    RETURN_IF_ERROR(ApplyUpdate(params[i], updates[i], lrs[i], decay, method));
  return absl::OkStatus();
}

absl::StatusOr<MemoryInfo> Backend::Memory() {
  return absl::UnimplementedError(
      absl::StrCat("memory: not reported by backend ", std::string(name())));
}

absl::Status Backend::NorMuonRowStats(absl::Span<const NorMuonRowBlock>,
                                      const MatrixView&, const MatrixView&) {
  return absl::UnimplementedError(absl::StrCat(
      "normuon row stats: not implemented by backend ", std::string(name())));
}

absl::Status Backend::SumSlices(const MatrixView&, const MatrixView&) {
  return absl::UnimplementedError(absl::StrCat(
      "sum slices: not implemented by backend ", std::string(name())));
}

absl::Status Backend::ApplyRowScaledUpdateBatch(absl::Span<const MatrixView>,
                                                absl::Span<const MatrixView>,
                                                absl::Span<const MatrixView>,
                                                absl::Span<const float>, float,
                                                WeightDecayMethod) {
  return absl::UnimplementedError(absl::StrCat(
      "row-scaled update: not implemented by backend ", std::string(name())));
}

absl::Status Backend::NorMuonFactors(absl::Span<const NorMuonRowBlock>,
                                     const MatrixView&, const MatrixView&,
                                     const MatrixView&, const MatrixView&,
                                     double, double) {
  return absl::UnimplementedError(absl::StrCat(
      "normuon: not implemented by backend ", std::string(name())));
}

absl::Status Backend::AdaMuonNormalize(const MatrixView&, const MatrixView&,
                                       const MatrixView&, double, float) {
  return absl::UnimplementedError(absl::StrCat(
      "adamuon: not implemented by backend ", std::string(name())));
}

absl::Status Backend::AdaMuonNormalizeBatch(
    absl::Span<const MatrixView> updates, absl::Span<const MatrixView> v_in,
    absl::Span<const MatrixView> v_out, double beta2, float eps) {
  RETURN_IF_ERROR(CheckAdaMuonBatch(updates, v_in, v_out));
  for (size_t i = 0; i < updates.size(); ++i)
    RETURN_IF_ERROR(
        AdaMuonNormalize(updates[i], v_in[i], v_out[i], beta2, eps));
  return absl::OkStatus();
}

namespace {

// An NS result's dtypes (NsResultDType): the work dtypes and Gram NS's fp16.
bool IsUpdateDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}

std::string Shape(const MatrixView& v) {
  return absl::StrCat(v.rows, "x", v.cols, " ",
                      std::string(DTypeName(v.dtype)));
}

}  // namespace

std::string_view MatmulPrecisionName(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::kHighest:
      return "highest";
    case MatmulPrecision::kHigh:
      return "high";
    case MatmulPrecision::kMedium:
      return "medium";
  }
  return "unknown";
}

absl::StatusOr<MatmulPrecision> ParseMatmulPrecision(std::string_view name) {
  for (MatmulPrecision p : {MatmulPrecision::kHighest, MatmulPrecision::kHigh,
                            MatmulPrecision::kMedium}) {
    if (MatmulPrecisionName(p) == name) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("fp32_matmul_prec '", std::string(name),
                   "' is not highest, high or medium"));
}

std::string_view WeightDecayMethodName(WeightDecayMethod method) {
  switch (method) {
    case WeightDecayMethod::kDecoupled:
      return "decoupled";
    case WeightDecayMethod::kIndependent:
      return "independent";
    case WeightDecayMethod::kCautious:
      return "cautious";
    case WeightDecayMethod::kNone:
      return "none";
  }
  return "unknown";
}

absl::Status Backend::GemmOut(Op op_a, Op op_b, float alpha,
                              const MatrixView& a, const MatrixView& b,
                              float beta, const MatrixView& c,
                              const MatrixView& d, MatmulPrecision precision) {
  if (beta != 0.0f) RETURN_IF_ERROR(Copy2D(d, c));
  return Gemm(op_a, op_b, alpha, a, b, beta, d, precision);
}

absl::Status Backend::GemmStridedBatchedOut(
    Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
    const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
    int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
    MatmulPrecision precision) {
  if (beta != 0.0f) {
    RETURN_IF_ERROR(CheckSameShape(d, c, "gemm d", "gemm c"));
    const int64_t es = int64_t(DTypeSize(c.dtype));
    for (int64_t i = 0; i < batch; ++i) {
      MatrixView ci = c, di = d;
      ci.data = static_cast<char*>(c.data) + i * stride_c * es;
      di.data = static_cast<char*>(d.data) + i * stride_d * es;
      RETURN_IF_ERROR(Copy2D(di, ci));
    }
  }
  return GemmStridedBatched(op_a, op_b, alpha, a, stride_a, b, stride_b, beta,
                            d, stride_d, batch, precision);
}

absl::Status Backend::SymmetricGemmStridedBatchedOut(
    Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
    const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
    int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
    MatmulPrecision precision) {
  if (d.rows != d.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("symmetric gemm: d must be square, got ", Shape(d)));
  }
  RETURN_IF_ERROR(GemmStridedBatchedOut(op_a, op_b, alpha, a, stride_a, b,
                                        stride_b, beta, c, stride_c, d,
                                        stride_d, batch, precision));
  return SymmetrizeFromLower(d, stride_d, batch);
}

absl::Status CheckView(const MatrixView& v, std::string_view what) {
  if (v.rows < 0 || v.cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), ": rows and cols must be >= 0, got ", Shape(v)));
  }
  if (v.rows > 1 && v.row_stride < v.cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), ": row_stride (", v.row_stride,
                     ") must be >= cols (", v.cols, ")"));
  }
  if (v.numel() > 0 && v.data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), ": data is null for a non-empty view"));
  }
  return absl::OkStatus();
}

absl::Status CheckGradCheckSlot(int slot, int count) {
  if (slot < 0 || slot >= count) {
    return absl::InvalidArgumentError(absl::StrCat("grad check: slot ", slot,
                                                   " is outside [0, ", count,
                                                   ") (grad_check_slots)"));
  }
  return absl::OkStatus();
}

absl::Status CheckGradCheckSlots(int slots, int count) {
  if (slots < 1 || slots > count) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad checks: ", slots, " slots asked for, outside [1, ",
                     count, "] (grad_check_slots)"));
  }
  return absl::OkStatus();
}

absl::Status CheckSameShape(const MatrixView& a, const MatrixView& b,
                            std::string_view what_a, std::string_view what_b) {
  if (auto s = CheckView(a, what_a); !s.ok()) return s;
  if (auto s = CheckView(b, what_b); !s.ok()) return s;
  if (a.rows != b.rows || a.cols != b.cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what_a), " (", Shape(a), ") and ", std::string(what_b),
        " (", Shape(b), ") must have the same shape"));
  }
  return absl::OkStatus();
}

absl::Status CheckCopy(const MatrixView& dst, const MatrixView& src) {
  RETURN_IF_ERROR(CheckSameShape(dst, src, "copy dst", "copy src"));
  const bool fp8_dst = dst.dtype == DType::kFloat8E4M3,
             fp8_src = src.dtype == DType::kFloat8E4M3;
  if (fp8_dst != fp8_src) {
    return absl::InvalidArgumentError(absl::StrCat(
        "copy: ", std::string(DTypeName(src.dtype)), " to ",
        std::string(DTypeName(dst.dtype)),
        " is not a conversion Copy2D makes (fp8_e4m3 copies only to "
        "fp8_e4m3: its block scales live apart from the view)"));
  }
  return absl::OkStatus();
}

absl::Status CheckDType(const MatrixView& v, DType dtype,
                        std::string_view what) {
  if (v.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), ": dtype must be ", std::string(DTypeName(dtype)),
        ", got ", std::string(DTypeName(v.dtype))));
  }
  return absl::OkStatus();
}

absl::Status CheckGemm(Op op_a, Op op_b, const MatrixView& a,
                       const MatrixView& b, const MatrixView& c,
                       MatmulPrecision precision) {
  if (auto s = CheckView(a, "gemm a"); !s.ok()) return s;
  if (auto s = CheckView(b, "gemm b"); !s.ok()) return s;
  if (auto s = CheckView(c, "gemm c"); !s.ok()) return s;
  const int64_t m = op_a == Op::kN ? a.rows : a.cols;
  const int64_t k = op_a == Op::kN ? a.cols : a.rows;
  const int64_t kb = op_b == Op::kN ? b.rows : b.cols;
  const int64_t n = op_b == Op::kN ? b.cols : b.rows;
  if (k != kb || c.rows != m || c.cols != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gemm: op(a) is ", m, "x", k, ", op(b) is ", kb, "x", n, ", c is ",
        c.rows, "x", c.cols, "; need op(a) m x k, op(b) k x n, c m x n"));
  }
  // kMedium: 16-bit operands and output, bf16 or fp16 (the Gram NS
  // iteration dtype), all three the same.
  const bool medium = precision == MatmulPrecision::kMedium;
  const DType want =
      medium ? (a.dtype == DType::kFloat16 ? DType::kFloat16 : DType::kBFloat16)
             : DType::kFloat32;
  for (const MatrixView* v : {&a, &b, &c}) {
    if (v->dtype != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gemm: precision ", std::string(MatmulPrecisionName(precision)),
          " needs ", medium ? "bf16 or fp16 (all the same)" : "fp32",
          " a, b and c; got a ", std::string(DTypeName(a.dtype)), ", b ",
          std::string(DTypeName(b.dtype)), ", c ",
          std::string(DTypeName(c.dtype))));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAddToDiagonal(const MatrixView& view, int64_t batch) {
  if (auto s = CheckView(view, "add_to_diagonal"); !s.ok()) return s;
  if (view.rows != view.cols || batch < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "add_to_diagonal: slices must be square and batch >= 0, got ",
        Shape(view), ", batch ", batch));
  }
  return absl::OkStatus();
}

absl::Status CheckNormalize(const MatrixView& src, const MatrixView& dst,
                            int64_t batch, float eps) {
  if (auto s = CheckSameShape(src, dst, "normalize src", "normalize dst");
      !s.ok()) {
    return s;
  }
  if (batch < 1 || src.rows % batch != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalize: batch (", batch,
                     ") must be >= 1 and divide rows (", src.rows, ")"));
  }
  if (!(eps > 0.0f) || !std::isfinite(eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalize: eps must be finite and > 0, got ", eps));
  }
  return absl::OkStatus();
}

namespace {
// Whether the bytes spanned by a and b (first to last element) intersect.
bool Overlap(const MatrixView& a, const MatrixView& b) {
  if (a.span_bytes() == 0 || b.span_bytes() == 0) return false;
  if (IsAbsent(a) || IsAbsent(b)) return false;
  const char* a0 = static_cast<const char*>(a.data);
  const char* b0 = static_cast<const char*>(b.data);
  return a0 < b0 + b.span_bytes() && b0 < a0 + a.span_bytes();
}
}  // namespace

namespace {
// An output may be Absent (not written): then only its shape is checked.
absl::Status CheckOutputShape(const MatrixView& grad, const MatrixView& v,
                              std::string_view what) {
  if (!IsAbsent(v)) return CheckSameShape(grad, v, "grad", what);
  if (v.rows == grad.rows && v.cols == grad.cols) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("grad (", Shape(grad), ") and ", std::string(what), " (",
                   Shape(v), ") must have the same shape"));
}

// fp8 state comes with its block scales and is contiguous (the blocks are
// runs of consecutive elements); other state has no scales.
absl::Status CheckStateScales(const MatrixView& momentum_in,
                              const MatrixView& momentum_out,
                              const BlockScales& scales) {
  const bool fp8_in = momentum_in.dtype == DType::kFloat8E4M3;
  const bool fp8_out = momentum_out.dtype == DType::kFloat8E4M3;
  if (fp8_in != fp8_out) {
    return absl::InvalidArgumentError(absl::StrCat(
        "momentum: momentum_in (", std::string(DTypeName(momentum_in.dtype)),
        ") and momentum_out (", std::string(DTypeName(momentum_out.dtype)),
        ") must both be fp8_e4m3 or neither"));
  }
  const bool has_scales = scales.in != nullptr || scales.out != nullptr;
  if (!fp8_in) {
    if (!has_scales) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "momentum: block scales are for fp8_e4m3 state only, the state is ",
        std::string(DTypeName(momentum_in.dtype))));
  }
  // An absent momentum_out stores no codes, so it needs no scales out.
  if (scales.in == nullptr ||
      (scales.out == nullptr && !IsAbsent(momentum_out))) {
    return absl::InvalidArgumentError(
        "momentum: fp8_e4m3 state needs its block scales (in and out)");
  }
  if (!momentum_in.contiguous() || !momentum_out.contiguous()) {
    return absl::InvalidArgumentError(
        "momentum: fp8_e4m3 state must be contiguous (its blocks are runs of "
        "consecutive elements)");
  }
  const bool in_place = momentum_out.data == momentum_in.data;
  if (!IsAbsent(momentum_out) && in_place != (scales.out == scales.in)) {
    return absl::InvalidArgumentError(
        "momentum: fp8_e4m3 state updated in place must update its scales in "
        "place too, and only then");
  }
  return absl::OkStatus();
}
}  // namespace

absl::Status CheckMomentum(const MatrixView& grad,
                           const MatrixView& momentum_in,
                           const MatrixView& momentum_out,
                           const MatrixView& out, const BlockScales& scales) {
  RETURN_IF_ERROR(CheckStateScales(momentum_in, momentum_out, scales));
  if (IsAbsent(momentum_out) && IsAbsent(out) && grad.numel() > 0) {
    return absl::InvalidArgumentError(
        "momentum: momentum_out and the NS input are both absent (nothing to "
        "write)");
  }
  if (auto s = CheckSameShape(grad, momentum_in, "grad", "momentum_in");
      !s.ok()) {
    return s;
  }
  RETURN_IF_ERROR(CheckOutputShape(grad, momentum_out, "momentum_out"));
  RETURN_IF_ERROR(CheckOutputShape(grad, out, "ns input"));
  if (Overlap(out, momentum_in) || Overlap(out, momentum_out)) {
    return absl::InvalidArgumentError(
        "momentum: the NS input buffer must not overlap the momentum state");
  }
  const bool in_place = momentum_out.data == momentum_in.data &&
                        momentum_out.row_stride == momentum_in.row_stride &&
                        momentum_out.dtype == momentum_in.dtype;
  if (!in_place &&
      (Overlap(momentum_out, momentum_in) || Overlap(momentum_out, grad))) {
    return absl::InvalidArgumentError(
        "momentum: momentum_out must be momentum_in (in place) or overlap "
        "neither momentum_in nor grad");
  }
  return absl::OkStatus();
}

absl::Status CheckMomentumBatch(absl::Span<const MatrixView> grads,
                                absl::Span<const MatrixView> momenta_in,
                                absl::Span<const MatrixView> momenta_out,
                                absl::Span<const MatrixView> outs,
                                absl::Span<const BlockScales> scales) {
  if (momenta_in.size() != grads.size() || momenta_out.size() != grads.size() ||
      outs.size() != grads.size() ||
      (!scales.empty() && scales.size() != grads.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "momentum batch: grads, momenta_in, momenta_out, outs and scales "
        "(if any) must have the same length, got ",
        grads.size(), ", ", momenta_in.size(), ", ", momenta_out.size(), ", ",
        outs.size(), ", ", scales.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckUpdate(const MatrixView& param, const MatrixView& update) {
  return CheckSameShape(param, update, "param", "update");
}

absl::Status CheckUpdateBatch(absl::Span<const MatrixView> params,
                              absl::Span<const MatrixView> updates,
                              absl::Span<const float> lrs) {
  if (updates.size() != params.size() || lrs.size() != params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "update batch: params, updates and lrs must have the same length, "
        "got ",
        params.size(), ", ", updates.size(), ", ", lrs.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckRowScaledUpdateBatch(absl::Span<const MatrixView> params,
                                       absl::Span<const MatrixView> updates,
                                       absl::Span<const MatrixView> row_factors,
                                       absl::Span<const float> lrs) {
  RETURN_IF_ERROR(CheckUpdateBatch(params, updates, lrs));
  if (row_factors.size() != params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "row-scaled update: ", params.size(),
        " params need as many row factors, got ", row_factors.size()));
  }
  for (size_t k = 0; k < params.size(); ++k) {
    RETURN_IF_ERROR(CheckUpdate(params[k], updates[k]));
    const MatrixView& f = row_factors[k];
    RETURN_IF_ERROR(CheckView(f, "row factors"));
    RETURN_IF_ERROR(CheckDType(f, DType::kFloat32, "row factors"));
    if (f.rows != params[k].rows || f.cols != 1 || !f.contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row-scaled update: param ", k, " has ", params[k].rows,
          " rows, its factors are ", Shape(f), " (need contiguous rows x 1)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAdamW(const MatrixView& param, const MatrixView& grad,
                        const MatrixView& exp_avg, const MatrixView& exp_avg_sq,
                        const AdamWMomentScales& scales) {
  if (auto s = CheckSameShape(param, grad, "param", "grad"); !s.ok()) return s;
  if (auto s = CheckSameShape(param, exp_avg, "param", "exp_avg"); !s.ok()) {
    return s;
  }
  if (auto s = CheckSameShape(param, exp_avg_sq, "param", "exp_avg_sq");
      !s.ok()) {
    return s;
  }
  const DType moments = exp_avg.dtype;
  if (!IsStateDType(moments) || exp_avg_sq.dtype != moments) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adamw: exp_avg and exp_avg_sq must be of one state dtype (fp32, "
        "bf16 or fp8_e4m3), got ",
        std::string(DTypeName(exp_avg.dtype)), " and ",
        std::string(DTypeName(exp_avg_sq.dtype))));
  }
  const bool fp8 = moments == DType::kFloat8E4M3;
  const bool has_scales =
      scales.exp_avg != nullptr || scales.exp_avg_sq != nullptr;
  if (!fp8 && has_scales) {
    return absl::InvalidArgumentError(
        "adamw: block scales are for fp8_e4m3 moments only");
  }
  if (fp8 && (scales.exp_avg == nullptr || scales.exp_avg_sq == nullptr ||
              !exp_avg.contiguous() || !exp_avg_sq.contiguous())) {
    return absl::InvalidArgumentError(
        "adamw: fp8_e4m3 moments must be contiguous and come with their "
        "block scales");
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckRowBuffer(const MatrixView& v, int64_t rows,
                            std::string_view what) {
  if (v.data == nullptr && v.rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckView(v, what));
  RETURN_IF_ERROR(CheckDType(v, DType::kFloat32, what));
  if (v.cols != 1 || v.rows < rows) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what),
                                                   ": needs at least ", rows,
                                                   "x1 fp32, got ", Shape(v)));
  }
  return absl::OkStatus();
}

absl::Status CheckRowBlock(const NorMuonRowBlock& b, int64_t k) {
  const MatrixView& u = b.update;
  const std::string what = absl::StrCat("normuon block ", k);
  RETURN_IF_ERROR(CheckView(u, what));
  if (!IsUpdateDType(u.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the update must be fp32, bf16 or fp16"));
  }
  if (b.valid < 0 || b.valid > u.rows || b.global0 < 0 ||
      b.global0 + b.valid > b.full_rows || b.full_cols < 1 ||
      b.row_offset < 0 || b.stats_offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": rows [", b.global0, ", +", b.valid, ") of ", b.full_rows, "x",
        b.full_cols, " do not fit the ", u.rows, " local rows"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckNorMuonBlocks(absl::Span<const NorMuonRowBlock> blocks,
                                const MatrixView& state,
                                const MatrixView& stats,
                                const MatrixView& staged,
                                const MatrixView& factors) {
  int64_t rows = 0, slots = 0;
  for (size_t k = 0; k < blocks.size(); ++k) {
    const NorMuonRowBlock& b = blocks[k];
    RETURN_IF_ERROR(CheckRowBlock(b, int64_t(k)));
    rows = std::max(rows, b.row_offset + b.update.rows);
    slots = std::max(slots, b.stats_offset + 2 * b.full_rows);
  }
  RETURN_IF_ERROR(CheckRowBuffer(state, rows, "normuon state"));
  RETURN_IF_ERROR(CheckRowBuffer(stats, slots, "normuon stats"));
  RETURN_IF_ERROR(CheckRowBuffer(staged, rows, "normuon staged state"));
  return CheckRowBuffer(factors, rows, "normuon factors");
}

absl::Status CheckSumSlices(const MatrixView& slices, const MatrixView& out) {
  RETURN_IF_ERROR(CheckView(slices, "sum slices"));
  RETURN_IF_ERROR(CheckDType(slices, DType::kFloat32, "sum slices"));
  if (!slices.contiguous()) {
    return absl::InvalidArgumentError("sum slices: slices must be contiguous");
  }
  return CheckRowBuffer(out, slices.cols, "sum slices out");
}

absl::Status CheckAdaMuon(const MatrixView& update, const MatrixView& v_in,
                          const MatrixView& v_out) {
  RETURN_IF_ERROR(CheckSameShape(update, v_in, "update", "moment2_in"));
  RETURN_IF_ERROR(CheckSameShape(update, v_out, "update", "moment2_out"));
  RETURN_IF_ERROR(CheckDType(v_in, DType::kFloat32, "moment2_in"));
  RETURN_IF_ERROR(CheckDType(v_out, DType::kFloat32, "moment2_out"));
  if (!IsUpdateDType(update.dtype)) {
    return absl::InvalidArgumentError(
        "adamuon: update must be fp32, bf16 or fp16");
  }
  return absl::OkStatus();
}

absl::Status CheckAdaMuonBatch(absl::Span<const MatrixView> updates,
                               absl::Span<const MatrixView> v_in,
                               absl::Span<const MatrixView> v_out) {
  if (v_in.size() != updates.size() || v_out.size() != updates.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("adamuon batch: ", updates.size(),
                     " updates need as "
                     "many moment2 views, got ",
                     v_in.size(), " and ", v_out.size()));
  }
  for (size_t i = 0; i < updates.size(); ++i)
    RETURN_IF_ERROR(CheckAdaMuon(updates[i], v_in[i], v_out[i]));
  return absl::OkStatus();
}

}  // namespace muond
