#pragma once
// Gram Newton–Schulz (Zhang, Amsel, Chen, Dao, "Gram Newton-Schulz",
// Dao-AILab 2026; peer code gram-newton-schulz 0.1.6): the polynomial of
// standard Newton–Schulz (newton_schulz.h) iterated on the small m x m Gram
// matrix R = X X^T and an accumulated Q with X_t = Q_t X_0, instead of the
// m x n iterate. For a wide X (m = rows <= n = cols), coefficients (a, b, c)
// at iteration i:
//   X = G / max(||G||_F, eps)   (fp32, muond's eps rule; then the iteration
//                                dtype); R = X X^T
//   restart (i in restarts):    X = Q X; R = X X^T
//   Z = b R + c R^2
//   Q = Z + a I                 (i == 0 or a restart)
//   Q = Q Z + a Q               (otherwise; = (aI + Z) Q)
//   unless i is last or i+1 a restart:
//     RZ = R Z + a R;  R = Z RZ + a RZ      (R <- (aI + Z)^2 R)
//   result X = Q X.
// All of R, Z, Q are polynomials in the first R after a restart, so they
// commute and every m x m product is symmetric: each runs on
// Backend::SymmetricGemmStridedBatchedOut. Tall inputs (rows > cols) run the
// transposed iteration without a transpose: R = X^T X, X = X Q.
// In exact arithmetic this is standard NS (tests: <= 1e-10 apart in fp64).
//
// Restarts: R accumulates rounding as spurious negative eigenvalues that the
// polynomial grows; re-forming X = Q X and R = X X^T resets them. Defaults
// per coefficient set, num_steps and iteration dtype (bf16's coarser
// rounding needs more): DefaultGramRestarts (coefficients.h).
//
// Iteration dtype: kMedium iterates in NsOptions::gram_dtype, fp16 by default
// (bf16 allowed); kHighest/kHigh in fp32 (kHigh: TF32 products). Why fp16:
// after the fp32 normalisation ||X||_F <= 1, so every entry of R, Z, Q and of
// the iterate stays within the polynomial's bounded range (|entries| ~ 1-10,
// never near fp16's 65504), and fp16's 10 mantissa bits against bf16's 7 give
// 8x smaller rounding in the quantities whose error the restarts fight; bf16's
// wider exponent range buys nothing here. The paper and its code iterate in
// fp16 after an fp32 normalisation for this reason (gram_newton_schulz.py:
// `X = X.to(torch.float16)`). The last product (Q X) writes the result in
// the iteration dtype; the step engine keeps it so (NsResultDType), as the
// update reads fp16 as cheaply as bf16, where a bf16 copy cost one more pass.
//
// Batched over same-shape matrices (strided batched GEMMs); a batch of one
// takes the unbatched Gemm for X-sized products. Workspaces are allocated
// once at Create. A zero matrix gives a zero result.
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/common/matrix_view.h"
#include "core/muon/coefficients.h"
#include "core/muon/newton_schulz.h"

namespace muond {

// Default aspect-ratio threshold (max/min side) from which Gram NS runs,
// by the short side. The FLOP model (full GEMMs, m = min side, n = max side,
// r = n/m: standard NS s (4 m^2 n + 2 m^3), Gram NS with 5 steps and one
// restart 8 m^2 n + 28 m^3) puts the crossover at 20 r + 10 = 8 r + 28,
// r = 1.5. Measured on H200 (bench/results/gpu_h200_step_vs_peer.md, section
// "Aspect-ratio crossover": `bench/gpu_step_bench.py --sweep-aspect`, bf16
// medium, step_bench's torch.optim.Muon settings, fp16 Gram with the default
// restarts, n = short side; standard ms / Gram ms, > 1 = Gram faster):
//   n \ m/n   1      1.25   1.5    2      3.5
//   1024      0.718  0.788  0.842  0.948  1.103   (batches of 16)
//   2048      0.872  0.973  1.034  1.269  1.558   (batches of 4)
//   4096      0.926  0.956  1.042  1.206  1.464   (batches of 2)
// From n = 2048 the crossover is just below 1.5, as modelled; at n = 1024 the
// Gram side's many small m x m launches cost more than their FLOPs and it
// moves to ~2.5 (linear between 2 and 3.5). Short side < 1536 (between the
// measured sizes): 2.5; >= 1536: 1.5.
inline constexpr double kDefaultGramMinAspectRatio = 1.5;
inline constexpr double kDefaultGramMinAspectRatioSmall = 2.5;
inline constexpr int64_t kGramSmallShortSideBelow = 1536;

// The default threshold for a matrix whose short side is `short_side`.
double DefaultGramMinAspectRatio(int64_t short_side);
// The threshold NsOptions resolves to for a rows x cols matrix:
// gram_min_aspect_ratio (one number for all sizes) when set, else
// DefaultGramMinAspectRatio(min side).
double GramMinAspectRatio(const NsOptions& options, int64_t rows, int64_t cols);
// Whether NewtonSchulz runs Gram NS for a rows x cols matrix: algorithm kGram,
// or kAuto at precision kMedium, and max/min side >= GramMinAspectRatio
// (square and near-square stay standard).
bool UsesGramNs(const NsOptions& options, int64_t rows, int64_t cols);
// The restart iterations NsOptions resolves to: gram_restarts, or
// DefaultGramRestarts for the coefficient type, num_steps and
// GramIterationDType.
std::vector<int> GramRestarts(const NsOptions& options);
// The dtype Gram NS iterates in: gram_dtype under kMedium, fp32 otherwise.
DType GramIterationDType(const NsOptions& options);

class GramNewtonSchulz {
 public:
  // Runs Gram NS for any shape (the aspect threshold is NewtonSchulz's
  // dispatch). Errors: ValidateNsOptions's; rows/cols/max_batch < 1;
  // allocation failures.
  static absl::StatusOr<std::unique_ptr<GramNewtonSchulz>> Create(
      Backend* backend, const NsOptions& options, int64_t rows, int64_t cols,
      int64_t max_batch = 1);
  ~GramNewtonSchulz();
  GramNewtonSchulz(const GramNewtonSchulz&) = delete;
  // The bytes Create allocates for the shape and max_batch: two batches of
  // the matrices and five of the m x m Gram iterates, in the work dtype.
  static int64_t WorkspaceBytes(const NsOptions& options, int64_t rows,
                                int64_t cols, int64_t max_batch);
  GramNewtonSchulz& operator=(const GramNewtonSchulz&) = delete;

  // As NewtonSchulz::Run (same views, dtypes and errors).
  absl::Status Run(const MatrixView& in, const MatrixView& out, int64_t batch);

  // The FLOPs Run executes per matrix, every product counted as a full GEMM
  // (2 m k n), symmetric ones included (what the CPU backend and cuBLASLt
  // run). c == 0 steps still run Z's product (alpha 0).
  double FlopsPerMatrix() const;
  // The same with the symmetric products at half (a lower-triangle kernel
  // computes only that): the algorithm's ideal count.
  double IdealFlopsPerMatrix() const;
  const std::vector<int>& restarts() const { return restarts_; }
  DType iteration_dtype() const { return dtype_; }

 private:
  GramNewtonSchulz(Backend* backend, NsOptions options, int64_t rows,
                   int64_t cols, int64_t max_batch,
                   std::vector<NsCoefficients> schedule);
  absl::Status AllocateWorkspace();
  bool IsRestart(int i) const;
  // FLOPs of the n x m products and of the m x m symmetric ones.
  double XProductFlops() const;
  double SymProductFlops() const;
  // d = alpha op(a) op(b) + beta c over m x m symmetric slices; a and b
  // slices `s_ab` elements apart (0: m*m, the m x m workspaces).
  absl::Status Sym(Op op_a, Op op_b, float alpha, const MatrixView& a,
                   const MatrixView& b, float beta, const MatrixView& c,
                   const MatrixView& d, int64_t batch, int64_t s_ab = 0);
  // R = X X^T (wide) or X^T X (tall) for the X slices at `x`.
  absl::Status FormR(const MatrixView& x, int64_t batch);
  // dst = Q X (wide) or X Q (tall); dst slices `sd` elements apart.
  absl::Status ApplyQ(const MatrixView& q, const MatrixView& x,
                      const MatrixView& dst, int64_t sd, int64_t batch);

  Backend* backend_;
  NsOptions options_;
  int64_t rows_, cols_, max_batch_;
  int64_t m_, n_;
  bool tall_;
  DType dtype_;
  std::vector<NsCoefficients> schedule_;
  std::vector<int> restarts_;
  void* x_[2] = {nullptr, nullptr};  // batch * rows * cols
  void* r_ = nullptr;                // batch * m * m each
  void* z_ = nullptr;
  void* rz_ = nullptr;
  void* q_[2] = {nullptr, nullptr};
};

}  // namespace muond
