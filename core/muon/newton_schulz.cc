#include "core/muon/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "core/muon/bounds.h"
#include "core/muon/gram_newton_schulz.h"

namespace muond {
namespace {

// Start row of lower-triangle block row i of k (i = k gives m): multiples of
// 8 so every block starts 16-byte aligned in bf16.
int64_t SyrkBlockStart(int64_t m, int k, int i) {
  if (i >= k) return m;
  return (m * i / k) / 8 * 8;
}

}  // namespace

DType NsWorkDType(MatmulPrecision precision) {
  return precision == MatmulPrecision::kMedium ? DType::kBFloat16
                                               : DType::kFloat32;
}

DType NsResultDType(const NsOptions& options, int64_t rows, int64_t cols) {
  return UsesGramNs(options, rows, cols) ? GramIterationDType(options)
                                         : NsWorkDType(options.precision);
}

MatrixView NsResultOver(const MatrixView& in, DType result) {
  return DTypeSize(result) == DTypeSize(in.dtype) ? AsDType(in, result) : in;
}

DType NewtonSchulz::result_dtype() const {
  return NsResultDType(options_, rows_, cols_);
}

int SyrkBlockRows(int64_t m, int requested) {
  if (requested <= 0) return 0;
  return int(std::min<int64_t>(requested, std::max<int64_t>(m / 8, 1)));
}

std::string_view NsAlgorithmName(NsAlgorithm algorithm) {
  switch (algorithm) {
    case NsAlgorithm::kGram:
      return "gram";
    case NsAlgorithm::kAuto:
      return "auto";
    default:
      return "standard";
  }
}

absl::StatusOr<NsAlgorithm> ParseNsAlgorithm(std::string_view name) {
  for (NsAlgorithm a :
       {NsAlgorithm::kStandard, NsAlgorithm::kGram, NsAlgorithm::kAuto}) {
    if (NsAlgorithmName(a) == name) return a;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "ns_algorithm '", std::string(name), "' is not standard, gram or auto"));
}

absl::StatusOr<DType> ParseGramDType(std::string_view name) {
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    if (DTypeName(t) == name) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("gram_dtype '", std::string(name), "' is not fp16 or bf16"));
}

namespace {

// The largest finite fp16 value. A custom coefficient above it is inf once
// Gram NS casts it to its fp16 iteration dtype (every step would write inf).
constexpr double kFp16Max = 65504.0;

// Custom coefficients must be fp16-representable where Gram NS can iterate in
// fp16 (gram, medium, gram_dtype fp16): refused at registration, not found
// as inf params after a step. The built-in sets are far inside the range.
absl::Status CheckFp16Coefficients(const NsOptions& options) {
  if (options.algorithm == NsAlgorithm::kStandard ||
      options.precision != MatmulPrecision::kMedium ||
      options.gram_dtype != DType::kFloat16) {
    return absl::OkStatus();
  }
  for (size_t i = 0; i < options.custom.size(); ++i) {
    const NsCoefficients& t = options.custom[i];
    if (std::fabs(t.a) > kFp16Max || std::fabs(t.b) > kFp16Max ||
        std::fabs(t.c) > kFp16Max) {
      return absl::InvalidArgumentError(absl::StrCat(
          "custom coefficients: tuple ", i, " (", t.a, ", ", t.b, ", ", t.c,
          ") is outside the fp16 range (|a|, |b|, |c| <= 65504) that Gram NS "
          "iterates in (ns_algorithm gram or auto, precision medium, "
          "gram_dtype fp16); use gram_dtype bf16, precision highest or "
          "smaller coefficients"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGramOptions(const NsOptions& options) {
  RETURN_IF_ERROR(CheckFp16Coefficients(options));
  if (options.gram_restarts.has_value()) {
    const std::vector<int>& r = *options.gram_restarts;
    for (size_t i = 0; i < r.size(); ++i) {
      if (r[i] < 1 || r[i] >= options.num_steps) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ns gram_restarts: each iteration must be in [1, num_steps = ",
            options.num_steps, "), got ", r[i]));
      }
      if (i > 0 && r[i] <= r[i - 1]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ns gram_restarts must be ascending and distinct, got ", r[i - 1],
            " then ", r[i]));
      }
    }
  }
  if (options.gram_dtype != DType::kFloat16 &&
      options.gram_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("ns gram_dtype must be fp16 or bf16, got ",
                     std::string(DTypeName(options.gram_dtype))));
  }
  const double ratio = options.gram_min_aspect_ratio;
  if (!(ratio == 0.0 || (std::isfinite(ratio) && ratio >= 1.0))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ns gram_min_aspect_ratio must be 0 (the default) or finite and >= 1, "
        "got ",
        ratio));
  }
  return absl::OkStatus();
}

absl::Status CheckNsRunViews(const MatrixView& in, const MatrixView& out,
                             int64_t batch, int64_t max_batch, int64_t rows,
                             int64_t cols) {
  if (batch < 1 || batch > max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("ns batch must be in [1, ", max_batch, "], got ", batch));
  }
  for (const MatrixView* v : {&in, &out}) {
    const char* what = v == &in ? "ns input" : "ns output";
    RETURN_IF_ERROR(CheckView(*v, what));
    // fp16 only out: an unnormalised input may overflow or underflow it.
    const bool f16_ok = v == &out && v->dtype == DType::kFloat16;
    if (v->dtype != DType::kFloat32 && v->dtype != DType::kBFloat16 &&
        !f16_ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " must be float32 or bfloat16",
                       v == &out ? " (or float16)" : "", ", got ",
                       std::string(DTypeName(v->dtype))));
    }
    if (v->rows != batch * rows || v->cols != cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " must be ", batch * rows, "x", cols, " (batch ", batch, " of ",
          rows, "x", cols, "), got ", v->rows, "x", v->cols));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateNsOptions(const NsOptions& options,
                               const Backend& backend) {
  if (options.num_steps < 1 || options.num_steps > kMaxNsSteps) {
    return absl::InvalidArgumentError(
        absl::StrCat("ns num_steps must be in [1, ", kMaxNsSteps, "], got ",
                     options.num_steps));
  }
  RETURN_IF_ERROR(CheckPositiveFloat32(options.eps, "ns eps"));
  RETURN_IF_ERROR(CoefficientSchedule(options.coefficient_type, options.custom,
                                      options.num_steps)
                      .status());
  if (!backend.SupportsPrecision(options.precision)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ns precision ", std::string(MatmulPrecisionName(options.precision)),
        " is not available on backend ", std::string(backend.name()),
        " (the CPU backend has highest and medium)"));
  }
  if (options.syrk_block_rows < 0 || options.syrk_block_rows > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("ns syrk_block_rows must be in [0, 16] (0 = auto), got ",
                     options.syrk_block_rows));
  }
  return ValidateGramOptions(options);
}

absl::Status NsGemm(Backend& backend, MatmulPrecision precision, Op op_a,
                    Op op_b, float alpha, const MatrixView& a, int64_t sa,
                    const MatrixView& b, int64_t sb, float beta,
                    const MatrixView& c, int64_t sc, int64_t batch) {
  if (batch == 1) {
    return backend.Gemm(op_a, op_b, alpha, a, b, beta, c, precision);
  }
  return backend.GemmStridedBatched(op_a, op_b, alpha, a, sa, b, sb, beta, c,
                                    sc, batch, precision);
}

absl::StatusOr<std::vector<NsCoefficients>> CheckNsCreateArgs(
    const Backend* backend, const NsOptions& options, int64_t rows,
    int64_t cols, int64_t max_batch) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError("ns backend must not be null");
  }
  RETURN_IF_ERROR(ValidateNsOptions(options, *backend));
  if (rows < 1 || cols < 1 || max_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ns rows, cols and max_batch must be >= 1, got ", rows,
                     ", ", cols, ", ", max_batch));
  }
  return CoefficientSchedule(options.coefficient_type, options.custom,
                             options.num_steps);
}

absl::StatusOr<std::unique_ptr<NewtonSchulz>> NewtonSchulz::Create(
    Backend* backend, const NsOptions& options, int64_t rows, int64_t cols,
    int64_t max_batch) {
  ASSIGN_OR_RETURN(std::vector<NsCoefficients> schedule,
                   CheckNsCreateArgs(backend, options, rows, cols, max_batch));
  std::unique_ptr<NewtonSchulz> ns(new NewtonSchulz(
      backend, options, rows, cols, max_batch, std::move(schedule)));
  if (UsesGramNs(options, rows, cols)) {
    ASSIGN_OR_RETURN(ns->gram_, GramNewtonSchulz::Create(backend, options, rows,
                                                         cols, max_batch));
  } else {
    RETURN_IF_ERROR(ns->AllocateWorkspace());
  }
  return ns;
}

NewtonSchulz::NewtonSchulz(Backend* backend, NsOptions options, int64_t rows,
                           int64_t cols, int64_t max_batch,
                           std::vector<NsCoefficients> schedule)
    : backend_(backend),
      options_(std::move(options)),
      rows_(rows),
      cols_(cols),
      max_batch_(max_batch),
      m_(std::min(rows, cols)),
      n_(std::max(rows, cols)),
      tall_(rows > cols),
      block_rows_(
          options_.use_syrk ? SyrkBlockRows(m_, options_.syrk_block_rows) : 0),
      work_dtype_(NsWorkDType(options_.precision)),
      schedule_(std::move(schedule)) {
  // use_syrk with syrk_block_rows = 0 forces the symmetric call; otherwise it
  // is taken where the backend has a lower-triangle kernel that beats the
  // full product for the shape at max_batch (A: m x m from inner n, B: m x m
  // from inner m). Decided once per instance, so every Run (batch of one
  // included) takes the same path.
  const bool forced = options_.use_syrk && block_rows_ == 0;
  sym_gram_ =
      block_rows_ == 0 &&
      (forced || backend_->FastSymmetricGemm(m_, n_, work_dtype_, max_batch_));
  sym_poly_ =
      block_rows_ == 0 &&
      (forced || backend_->FastSymmetricGemm(m_, m_, work_dtype_, max_batch_));
}

NewtonSchulz::~NewtonSchulz() {
  for (void* p : {x_[0], x_[1], a_, b_}) {
    if (p != nullptr) backend_->Free(p);
  }
}

int64_t NewtonSchulz::WorkspaceBytes(const NsOptions& options, int64_t rows,
                                     int64_t cols, int64_t max_batch) {
  if (UsesGramNs(options, rows, cols)) {
    return GramNewtonSchulz::WorkspaceBytes(options, rows, cols, max_batch);
  }
  const int64_t es = int64_t(DTypeSize(NsWorkDType(options.precision)));
  const int64_t m = std::min(rows, cols);
  return max_batch * es * (2 * rows * cols + 2 * m * m);
}

absl::Status NewtonSchulz::AllocateWorkspace() {
  const int64_t es = int64_t(DTypeSize(work_dtype_));
  ASSIGN_OR_RETURN(x_[0], backend_->Allocate(max_batch_ * rows_ * cols_ * es));
  ASSIGN_OR_RETURN(x_[1], backend_->Allocate(max_batch_ * rows_ * cols_ * es));
  ASSIGN_OR_RETURN(a_, backend_->Allocate(max_batch_ * m_ * m_ * es));
  ASSIGN_OR_RETURN(b_, backend_->Allocate(max_batch_ * m_ * m_ * es));
  return absl::OkStatus();
}

double NewtonSchulz::FlopsPerMatrix() const {
  const double m = double(m_), n = double(n_);
  return options_.num_steps * (4.0 * m * m * n + 2.0 * m * m * m);
}

double NewtonSchulz::RunFlopsPerMatrix() const {
  return gram_ != nullptr ? gram_->FlopsPerMatrix() : FlopsPerMatrix();
}

absl::Status NewtonSchulz::Mm(Op op_a, Op op_b, float alpha,
                              const MatrixView& a, int64_t sa,
                              const MatrixView& b, int64_t sb, float beta,
                              const MatrixView& c, int64_t sc, int64_t batch) {
  return NsGemm(*backend_, options_.precision, op_a, op_b, alpha, a, sa, b, sb,
                beta, c, sc, batch);
}

absl::Status NewtonSchulz::MmOut(Op op_a, Op op_b, float alpha,
                                 const MatrixView& a, int64_t sa,
                                 const MatrixView& b, int64_t sb, float beta,
                                 const MatrixView& c, int64_t sc,
                                 const MatrixView& d, int64_t sd,
                                 int64_t batch) {
  if (batch == 1) {
    return backend_->GemmOut(op_a, op_b, alpha, a, b, beta, c, d,
                             options_.precision);
  }
  return backend_->GemmStridedBatchedOut(op_a, op_b, alpha, a, sa, b, sb, beta,
                                         c, sc, d, sd, batch,
                                         options_.precision);
}

absl::Status NewtonSchulz::Gram(const MatrixView& x, int64_t sx,
                                const MatrixView& a, int64_t batch) {
  const int64_t mm = m_ * m_;
  const Op lhs = tall_ ? Op::kT : Op::kN, rhs = tall_ ? Op::kN : Op::kT;
  if (sym_gram_) {
    return backend_->SymmetricGemmStridedBatchedOut(lhs, rhs, 1.0f, x, sx, x,
                                                    sx, 0.0f, a, mm, a, mm,
                                                    batch, options_.precision);
  }
  const int k = block_rows_;
  if (k <= 1) return Mm(lhs, rhs, 1.0f, x, sx, x, sx, 0.0f, a, mm, batch);
  for (int i = 0; i < k; ++i) {
    const int64_t i0 = SyrkBlockStart(m_, k, i);
    const int64_t ti = SyrkBlockStart(m_, k, i + 1) - i0;
    // Block row i of the lower triangle: rows [i0, i0+ti), cols [0, i0+ti).
    const MatrixView rows_i =
        tall_ ? x.Block(0, i0, n_, ti) : x.Block(i0, 0, ti, n_);
    const MatrixView upto =
        tall_ ? x.Block(0, 0, n_, i0 + ti) : x.Block(0, 0, i0 + ti, n_);
    RETURN_IF_ERROR(Mm(lhs, rhs, 1.0f, rows_i, sx, upto, sx, 0.0f,
                       a.Block(i0, 0, ti, i0 + ti), mm, batch));
  }
  return backend_->SymmetrizeFromLower(a, mm, batch);
}

absl::Status NewtonSchulz::Poly(const MatrixView& a, float b, float c,
                                const MatrixView& b_out, int64_t batch) {
  const int64_t mm = m_ * m_;
  if (sym_poly_) {
    // A is symmetric, so A A = A A^T: (N,T) reads both operands K-major.
    return backend_->SymmetricGemmStridedBatchedOut(Op::kN, Op::kT, c, a, mm, a,
                                                    mm, b, a, mm, b_out, mm,
                                                    batch, options_.precision);
  }
  const int k = block_rows_;
  if (k <= 1) {
    return MmOut(Op::kN, Op::kN, c, a, mm, a, mm, b, a, mm, b_out, mm, batch);
  }
  for (int i = 0; i < k; ++i) {
    const int64_t i0 = SyrkBlockStart(m_, k, i);
    const int64_t ti = SyrkBlockStart(m_, k, i + 1) - i0;
    RETURN_IF_ERROR(MmOut(Op::kN, Op::kN, c, a.Block(i0, 0, ti, m_), mm,
                          a.Block(0, 0, m_, i0 + ti), mm, b,
                          a.Block(i0, 0, ti, i0 + ti), mm,
                          b_out.Block(i0, 0, ti, i0 + ti), mm, batch));
  }
  return backend_->SymmetrizeFromLower(b_out, mm, batch);
}

absl::Status NewtonSchulz::Run(const MatrixView& in, const MatrixView& out,
                               int64_t batch) {
  if (gram_ != nullptr) return gram_->Run(in, out, batch);
  RETURN_IF_ERROR(CheckNsRunViews(in, out, batch, max_batch_, rows_, cols_));
  const int64_t sx = rows_ * cols_, mm = m_ * m_;
  auto x_full = [&](int i) {
    return ContiguousView(x_[i], work_dtype_, batch * rows_, cols_);
  };
  auto x_slice = [&](int i) {
    return ContiguousView(x_[i], work_dtype_, rows_, cols_);
  };
  const MatrixView a = ContiguousView(a_, work_dtype_, m_, m_);
  const MatrixView b_buf = ContiguousView(b_, work_dtype_, m_, m_);
  // The last step writes `out` directly when it is in the work dtype.
  const bool into_out = out.dtype == work_dtype_;
  const int64_t out_ld = std::max(out.row_stride, out.cols);
  MatrixView out_slice = out;
  out_slice.rows = rows_;

  // Normalise into the workspace (never in place in the caller's buffer).
  RETURN_IF_ERROR(
      backend_->FrobeniusNormalize(in, x_full(0), batch, options_.eps));
  int cur = 0;
  const int steps = static_cast<int>(schedule_.size());
  for (int s = 0; s < steps; ++s) {
    const NsCoefficients& k = schedule_[s];
    const MatrixView x = x_slice(cur);
    RETURN_IF_ERROR(Gram(x, sx, a, batch));
    MatrixView poly = a;
    float alpha = k.b;  // c == 0: X <- a X + b A X (cubic step, no A^2)
    if (k.c != 0.0f) {  // B = b A + c A^2 into the B buffer (A only read)
      RETURN_IF_ERROR(Poly(a, k.b, k.c, b_buf, batch));
      poly = b_buf;
      alpha = 1.0f;
    }
    const bool last = s + 1 == steps;
    // X_next = a X + P X (ping-pong buffers: X is read as C, never copied).
    const MatrixView next = last && into_out ? out_slice : x_slice(1 - cur);
    const int64_t s_next = last && into_out ? rows_ * out_ld : sx;
    if (tall_) {  // X^T <- a X^T + P X^T  <=>  X <- a X + X P^T
      RETURN_IF_ERROR(MmOut(Op::kN, Op::kT, alpha, x, sx, poly, mm, k.a, x, sx,
                            next, s_next, batch));
    } else {
      RETURN_IF_ERROR(MmOut(Op::kN, Op::kN, alpha, poly, mm, x, sx, k.a, x, sx,
                            next, s_next, batch));
    }
    cur = 1 - cur;
  }
  if (!into_out) RETURN_IF_ERROR(backend_->Copy2D(out, x_full(cur)));
  return absl::OkStatus();
}

}  // namespace muond
