#include "core/muon/gram_newton_schulz.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"

namespace muond {

double DefaultGramMinAspectRatio(int64_t short_side) {
  return short_side < kGramSmallShortSideBelow ? kDefaultGramMinAspectRatioSmall
                                               : kDefaultGramMinAspectRatio;
}

double GramMinAspectRatio(const NsOptions& options, int64_t rows,
                          int64_t cols) {
  return options.gram_min_aspect_ratio > 0
             ? options.gram_min_aspect_ratio
             : DefaultGramMinAspectRatio(std::min(rows, cols));
}

bool UsesGramNs(const NsOptions& options, int64_t rows, int64_t cols) {
  if (options.algorithm == NsAlgorithm::kStandard) return false;
  if (options.algorithm == NsAlgorithm::kAuto &&
      options.precision != MatmulPrecision::kMedium) {
    return false;  // auto: Gram in 16 bits only (NsAlgorithm)
  }
  const double lo = double(std::min(rows, cols)),
               hi = double(std::max(rows, cols));
  return hi >= GramMinAspectRatio(options, rows, cols) * lo;
}

std::vector<int> GramRestarts(const NsOptions& options) {
  if (options.gram_restarts.has_value()) return *options.gram_restarts;
  return DefaultGramRestarts(options.coefficient_type, options.num_steps,
                             GramIterationDType(options));
}

DType GramIterationDType(const NsOptions& options) {
  return options.precision == MatmulPrecision::kMedium ? options.gram_dtype
                                                       : DType::kFloat32;
}

absl::StatusOr<std::unique_ptr<GramNewtonSchulz>> GramNewtonSchulz::Create(
    Backend* backend, const NsOptions& options, int64_t rows, int64_t cols,
    int64_t max_batch) {
  ASSIGN_OR_RETURN(std::vector<NsCoefficients> schedule,
                   CheckNsCreateArgs(backend, options, rows, cols, max_batch));
  std::unique_ptr<GramNewtonSchulz> ns(new GramNewtonSchulz(
      backend, options, rows, cols, max_batch, std::move(schedule)));
  RETURN_IF_ERROR(ns->AllocateWorkspace());
  return ns;
}

GramNewtonSchulz::GramNewtonSchulz(Backend* backend, NsOptions options,
                                   int64_t rows, int64_t cols,
                                   int64_t max_batch,
                                   std::vector<NsCoefficients> schedule)
    : backend_(backend),
      options_(std::move(options)),
      rows_(rows),
      cols_(cols),
      max_batch_(max_batch),
      m_(std::min(rows, cols)),
      n_(std::max(rows, cols)),
      tall_(rows > cols),
      dtype_(GramIterationDType(options_)),
      schedule_(std::move(schedule)),
      restarts_(GramRestarts(options_)) {}

GramNewtonSchulz::~GramNewtonSchulz() {
  for (void* p : {x_[0], x_[1], r_, z_, rz_, q_[0], q_[1]}) {
    if (p != nullptr) backend_->Free(p);
  }
}

int64_t GramNewtonSchulz::WorkspaceBytes(const NsOptions& options, int64_t rows,
                                         int64_t cols, int64_t max_batch) {
  const int64_t es = int64_t(DTypeSize(NsWorkDType(options.precision)));
  const int64_t m = std::min(rows, cols);
  return max_batch * es * (2 * rows * cols + 5 * m * m);
}

absl::Status GramNewtonSchulz::AllocateWorkspace() {
  const int64_t es = int64_t(DTypeSize(dtype_));
  const int64_t xb = max_batch_ * rows_ * cols_ * es;
  const int64_t mb = max_batch_ * m_ * m_ * es;
  for (void** p : {&x_[0], &x_[1]}) {
    ASSIGN_OR_RETURN(*p, backend_->Allocate(xb));
  }
  for (void** p : {&r_, &z_, &rz_, &q_[0], &q_[1]}) {
    ASSIGN_OR_RETURN(*p, backend_->Allocate(mb));
  }
  return absl::OkStatus();
}

bool GramNewtonSchulz::IsRestart(int i) const {
  return i != 0 &&
         std::find(restarts_.begin(), restarts_.end(), i) != restarts_.end();
}

double GramNewtonSchulz::XProductFlops() const {
  // R = X X^T once, final Q X once, and per restart X = Q X plus R.
  const double mmn = double(m_) * double(m_) * double(n_);
  const double restarts =
      double(std::count_if(restarts_.begin(), restarts_.end(), [&](int i) {
        return i > 0 && i < int(schedule_.size());
      }));
  return 2.0 * mmn * (2.0 + 2.0 * restarts);
}

double GramNewtonSchulz::SymProductFlops() const {
  const double m3 = 2.0 * double(m_) * double(m_) * double(m_);
  const int steps = int(schedule_.size());
  double products = 0;
  for (int i = 0; i < steps; ++i) {
    products += 1;                                          // Z
    if (i != 0 && !IsRestart(i)) products += 1;             // Q Z
    if (i + 1 < steps && !IsRestart(i + 1)) products += 2;  // R Z, Z RZ
  }
  return products * m3;
}

double GramNewtonSchulz::FlopsPerMatrix() const {
  return XProductFlops() + SymProductFlops();
}

double GramNewtonSchulz::IdealFlopsPerMatrix() const {
  // Half of each symmetric product; of the X-sized ones, the R = X X^T half
  // (1 + restarts of the 2 + 2 restarts products) is symmetric.
  const double x = XProductFlops();
  return 0.75 * x + 0.5 * SymProductFlops();
}

absl::Status GramNewtonSchulz::Sym(Op op_a, Op op_b, float alpha,
                                   const MatrixView& a, const MatrixView& b,
                                   float beta, const MatrixView& c,
                                   const MatrixView& d, int64_t batch,
                                   int64_t s_ab) {
  const int64_t mm = m_ * m_;
  const int64_t sab = s_ab > 0 ? s_ab : mm;
  return backend_->SymmetricGemmStridedBatchedOut(op_a, op_b, alpha, a, sab, b,
                                                  sab, beta, c, mm, d, mm,
                                                  batch, options_.precision);
}

absl::Status GramNewtonSchulz::FormR(const MatrixView& x, int64_t batch) {
  const MatrixView r = ContiguousView(r_, dtype_, m_, m_);
  const int64_t sx = rows_ * cols_;
  return tall_ ? Sym(Op::kT, Op::kN, 1.0f, x, x, 0.0f, r, r, batch, sx)
               : Sym(Op::kN, Op::kT, 1.0f, x, x, 0.0f, r, r, batch, sx);
}

absl::Status GramNewtonSchulz::ApplyQ(const MatrixView& q, const MatrixView& x,
                                      const MatrixView& dst, int64_t sd,
                                      int64_t batch) {
  const MatrixView& lhs = tall_ ? x : q;
  const MatrixView& rhs = tall_ ? q : x;
  const int64_t sx = rows_ * cols_, mm = m_ * m_;
  return NsGemm(*backend_, options_.precision, Op::kN, Op::kN, 1.0f, lhs,
                tall_ ? sx : mm, rhs, tall_ ? mm : sx, 0.0f, dst, sd, batch);
}

absl::Status GramNewtonSchulz::Run(const MatrixView& in, const MatrixView& out,
                                   int64_t batch) {
  RETURN_IF_ERROR(CheckNsRunViews(in, out, batch, max_batch_, rows_, cols_));
  auto x_slice = [&](int i) {
    return ContiguousView(x_[i], dtype_, rows_, cols_);
  };
  auto sq = [&](void* p) { return ContiguousView(p, dtype_, m_, m_); };
  const MatrixView r = sq(r_), rz = sq(rz_);
  // Z's and Q's buffers trade places when Q is made from Z (below).
  void* zb = z_;
  void* qb[2] = {q_[0], q_[1]};
  RETURN_IF_ERROR(backend_->FrobeniusNormalize(
      in, ContiguousView(x_[0], dtype_, batch * rows_, cols_), batch,
      options_.eps));
  int cur = 0, qi = 0;
  RETURN_IF_ERROR(FormR(x_slice(cur), batch));
  const int steps = int(schedule_.size());
  for (int i = 0; i < steps; ++i) {
    const NsCoefficients& k = schedule_[i];
    if (IsRestart(i)) {  // X = Q X; R = X X^T
      RETURN_IF_ERROR(ApplyQ(sq(qb[qi]), x_slice(cur), x_slice(1 - cur),
                             rows_ * cols_, batch));
      cur = 1 - cur;
      RETURN_IF_ERROR(FormR(x_slice(cur), batch));
    }
    // Z = c R R + b R (c == 0 still runs the product with alpha 0).
    const MatrixView z = sq(zb);
    RETURN_IF_ERROR(Sym(Op::kN, Op::kN, k.c, r, r, k.b, r, z, batch));
    const bool fresh_q = i == 0 || IsRestart(i);
    if (!fresh_q) {  // Q = Q Z + a Q
      RETURN_IF_ERROR(Sym(Op::kN, Op::kN, 1.0f, sq(qb[qi]), z, k.a, sq(qb[qi]),
                          sq(qb[1 - qi]), batch));
      qi = 1 - qi;
    }
    if (i + 1 < steps && !IsRestart(i + 1)) {  // R <- (aI + Z)^2 R
      RETURN_IF_ERROR(Sym(Op::kN, Op::kN, 1.0f, r, z, k.a, r, rz, batch));
      RETURN_IF_ERROR(Sym(Op::kN, Op::kN, 1.0f, z, rz, k.a, rz, r, batch));
    }
    if (fresh_q) {
      // Q = Z + a I: Z's buffer becomes Q, its diagonal shifted in place
      // (Z is not read again this step), and Q's old buffer takes the next
      // Z; no m x m copy.
      RETURN_IF_ERROR(backend_->AddToDiagonal(z, m_ * m_, batch, k.a));
      std::swap(zb, qb[qi]);
    }
  }
  // Result X = Q X, straight into `out` when it has the iteration dtype.
  if (out.dtype == dtype_) {
    MatrixView out_slice = out;
    out_slice.rows = rows_;
    const int64_t out_ld = std::max(out.row_stride, out.cols);
    return ApplyQ(sq(qb[qi]), x_slice(cur), out_slice, rows_ * out_ld, batch);
  }
  RETURN_IF_ERROR(
      ApplyQ(sq(qb[qi]), x_slice(cur), x_slice(1 - cur), rows_ * cols_, batch));
  return backend_->Copy2D(
      out, ContiguousView(x_[1 - cur], dtype_, batch * rows_, cols_));
}

}  // namespace muond
