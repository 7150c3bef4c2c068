#pragma once
// Newton–Schulz orthogonalisation, written once over the Backend interface.
//
// For a matrix G (rows x cols, fp32 or bf16), with m = min(rows, cols):
//   X = G / max(||G||_F, eps)                    (EO newton_schulz, HEAD eps)
//   per step (a, b, c) of the coefficient schedule:
//     A = X X^T   (m x m: for rows > cols the iteration runs on G^T, i.e.
//                  A = X^T X and X <- a X + X B^T, which is the transposed
//                  iteration without materialising a transpose)
//     B = b A + c A^2;  X <- a X + B X             (c == 0: X <- a X + b A X)
//   result X (rows x cols, fp32, bf16 or fp16), unscaled: the Muon scale is
//   applied by the update (muon_update.h, MuonAdjustedLr).
// Sources: EO (NVIDIA-NeMo/Emerging-Optimizers) muon_utils.py newton_schulz /
// newton_schulz_step (eps placement, the transposed iteration); coefficient
// sets and their sources in coefficients.h.
//
// Precision (NsOptions::precision, EO fp32_matmul_prec):
//   kHighest  fp32 GEMMs.
//   kHigh     TF32 GEMMs, X kept in fp32 (CUDA only: CPUs have no TF32).
//   kMedium   bf16 operands and outputs, fp32 accumulation; X, A and B are
//             kept in bf16 across steps. The step engine keeps the NS input
//             and output in bf16 too (NsWorkDType), as torch.optim.Muon
//             does (grad.bfloat16() first, the bf16 result added to the
//             fp32 param): no fp32 copies on the way in or out. Gram NS's
//             result stays in its fp16 (NsResultDType).
// Symmetric products: A = X X^T and B = b A + c A A are symmetric, so they
// can be formed by Backend::SymmetricGemmStridedBatchedOut (lower triangle +
// mirror). By default that call is used where the backend's lower-triangle
// kernel beats the full product (FastSymmetricGemm: the sm_90a kernel on
// H100/H200 for bf16/fp16 work, i.e. kMedium, m >= 3072: 1.2-1.5x on those
// products; bench/results/gpu_h200_sym_gemm.md) and full products elsewhere.
// use_syrk forces it everywhere (on other backends and devices: full product +
// mirror). use_syrk with syrk_block_rows = k >= 1 runs the legacy block-row
// path instead (k GEMMs over lower block rows of height ~m/k, then the mirror;
// k = 1 is the full product), kept for comparison benchmarks. Same math,
// different rounding.
//
// A batch of same-shape matrices runs through strided-batched GEMMs; a batch
// of one takes the unbatched (Gemm) path, so its result is bitwise equal to
// an unbatched call. A zero matrix gives a zero result (never NaN).
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/common/matrix_view.h"
#include "core/muon/coefficients.h"

namespace muond {

// Which Newton–Schulz iteration runs (core/muon/gram_newton_schulz.h for
// kGram: the same polynomial iterated on the Gram matrix R = X X^T and an
// accumulated Q, with restarts; square and near-square matrices stay on
// kStandard below gram_min_aspect_ratio). kAuto, the default: Gram where it
// is faster (the same aspect rule, measured on an H200) and iterates in 16
// bits (precision kMedium, where the numerics suite bounds its error by
// standard bf16 NS's and its sigma_max at every shape class it takes);
// standard NS at kHighest/kHigh, so an fp32 run stays the fp32 reference's.
enum class NsAlgorithm : int32_t { kStandard = 0, kGram = 1, kAuto = 2 };
std::string_view NsAlgorithmName(NsAlgorithm algorithm);
// "standard", "gram" or "auto"; InvalidArgument naming ns_algorithm
// otherwise.
absl::StatusOr<NsAlgorithm> ParseNsAlgorithm(std::string_view name);
// Gram NS iteration dtypes by DTypeName: "fp16" or "bf16"; InvalidArgument
// naming gram_dtype otherwise.
absl::StatusOr<DType> ParseGramDType(std::string_view name);

struct NsOptions {
  CoefficientType coefficient_type = CoefficientType::kQuintic;
  std::vector<NsCoefficients> custom;  // only with kCustom
  int num_steps = 5;                   // 1..kMaxNsSteps (bounds.h)
  float eps = 1e-15f;                  // > 0; EO HEAD default (commit 7ebd3cf)
  MatmulPrecision precision = MatmulPrecision::kHighest;
  // Symmetric products through SymmetricGemmStridedBatchedOut on every
  // backend (the default takes them only where FastSymmetricGemm).
  bool use_syrk = false;
  // With use_syrk: 0 = SymmetricGemmStridedBatchedOut; 1..16 = the legacy
  // lower-triangle block-row path with that many block rows (1 = the full
  // product; for benchmarks).
  int syrk_block_rows = 0;
  NsAlgorithm algorithm = NsAlgorithm::kAuto;
  // Gram NS restart iterations (each in [1, num_steps), ascending, distinct;
  // empty = no restart); nullopt = the default for the coefficient set,
  // num_steps and iteration dtype (GramRestarts, gram_newton_schulz.h).
  std::optional<std::vector<int>> gram_restarts;
  // Gram NS iteration dtype under kMedium: kFloat16 (default) or kBFloat16.
  // kHighest/kHigh iterate in fp32.
  DType gram_dtype = DType::kFloat16;
  // Gram NS runs only where max(rows, cols) / min(rows, cols) >= this
  // (>= 1, one number for all sizes); 0 = the measured size-aware default
  // (DefaultGramMinAspectRatio: 2.5 below a short side of 1536, else 1.5).
  double gram_min_aspect_ratio = 0.0;

  bool operator==(const NsOptions&) const = default;
};

// The dtype Newton–Schulz iterates in for `precision`: bf16 for kMedium,
// fp32 otherwise. The step engine stores NS inputs and outputs (and
// exchanges them) in buffers of this dtype; the outputs are read in
// NsResultDType (fp16 from Gram NS under kMedium, the same size).
DType NsWorkDType(MatmulPrecision precision);

// The dtype NS writes its result in without a converting pass, for a
// rows x cols matrix: Gram NS's iteration dtype where the shape runs Gram
// (UsesGramNs; fp16 under kMedium by default: its last product writes fp16,
// and a bf16 copy would cost one more pass over the matrix), else
// NsWorkDType. Both are 2 bytes under kMedium, so the step engine keeps L_i's
// buffers in the work dtype and reads a param's update in this dtype.
DType NsResultDType(const NsOptions& options, int64_t rows, int64_t cols);

// The view to write an NS result of dtype `result` over its input `in`:
// `in`'s memory read as `result` where the two have the same element size
// (Run then writes it without a converting pass), else `in` (one
// converting copy at Run's end).
MatrixView NsResultOver(const MatrixView& in, DType result);

// The legacy block-row count use_syrk runs with for an m x m product:
// `requested` clamped to m/8 (blocks of >= 8 rows); 0 when requested <= 0
// (SymmetricGemmStridedBatchedOut, no block rows).
int SyrkBlockRows(int64_t m, int requested);

// InvalidArgument naming the field and the rule: num_steps out of [1,
// kMaxNsSteps], eps not finite or <= 0, custom list rules
// (CoefficientSchedule), a precision the backend lacks (e.g. high on CPU: an
// error, never a silent change), syrk_block_rows outside [0, 16]; Gram
// fields (checked whatever the algorithm, so a bad value never waits for a
// shape that selects Gram): gram_restarts each in [1, num_steps), ascending
// and distinct; gram_dtype fp16 or bf16; gram_min_aspect_ratio 0 or finite
// and >= 1; custom coefficients within fp16's range (|a|, |b|, |c| <= 65504)
// where Gram can iterate in fp16 (gram, medium, gram_dtype fp16).
absl::Status ValidateNsOptions(const NsOptions& options,
                               const Backend& backend);
// The Gram fields' rules of ValidateNsOptions alone (no backend needed:
// MuonOptions::Validate uses it at registration).
absl::Status ValidateGramOptions(const NsOptions& options);

// c = alpha op(a) op(b) + beta c over `batch` slices (per-slice strides in
// elements); a batch of one is the plain Gemm, so its result is bitwise an
// unbatched call's (the NS numerics contract).
absl::Status NsGemm(Backend& backend, MatmulPrecision precision, Op op_a,
                    Op op_b, float alpha, const MatrixView& a, int64_t sa,
                    const MatrixView& b, int64_t sb, float beta,
                    const MatrixView& c, int64_t sc, int64_t batch);

// The checks both NS engines' Create run (a backend, ValidateNsOptions,
// rows/cols/max_batch >= 1), then the coefficient schedule they iterate.
absl::StatusOr<std::vector<NsCoefficients>> CheckNsCreateArgs(
    const Backend* backend, const NsOptions& options, int64_t rows,
    int64_t cols, int64_t max_batch);

// The shape and dtype rules of NewtonSchulz::Run's views (InvalidArgument
// naming `ns input` / `ns output` / `ns batch`), shared with
// GramNewtonSchulz::Run.
absl::Status CheckNsRunViews(const MatrixView& in, const MatrixView& out,
                             int64_t batch, int64_t max_batch, int64_t rows,
                             int64_t cols);

class GramNewtonSchulz;

// Owns the workspace for one matrix shape and up to `max_batch` matrices,
// allocated once on the backend at creation and reused by every Run. Not
// thread-safe; calls are stream-ordered on the backend.
//
// With algorithm kGram and max/min side >= GramMinAspectRatio the matrices
// run Gram Newton–Schulz (gram_newton_schulz.h), which this object owns and
// Run delegates to; otherwise standard NS.
class NewtonSchulz {
 public:
  // Errors: ValidateNsOptions's; rows/cols < 1 or max_batch < 1; allocation
  // failures.
  static absl::StatusOr<std::unique_ptr<NewtonSchulz>> Create(
      Backend* backend, const NsOptions& options, int64_t rows, int64_t cols,
      int64_t max_batch = 1);
  ~NewtonSchulz();
  NewtonSchulz(const NewtonSchulz&) = delete;
  // The bytes Create allocates for the shape and max_batch (Gram NS's where
  // the shape runs it; standard NS: two batches of the matrices and two of
  // the m x m products, in the work dtype).
  static int64_t WorkspaceBytes(const NsOptions& options, int64_t rows,
                                int64_t cols, int64_t max_batch);
  NewtonSchulz& operator=(const NewtonSchulz&) = delete;

  // in:  fp32 or bf16, (batch*rows) x cols, the batch matrices stacked
  //      along rows; any row_stride. Read only (never normalised in place).
  // out: fp32, bf16 or fp16, same shape, any row_stride; may be the same
  //      memory as `in`. In result_dtype() the last step writes it
  //      directly; otherwise one converting copy.
  // 1 <= batch <= max_batch. Errors: InvalidArgument naming `ns input` /
  // `ns output` and the shape rule.
  absl::Status Run(const MatrixView& in, const MatrixView& out, int64_t batch);

  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t max_batch() const { return max_batch_; }
  const NsOptions& options() const { return options_; }
  // NsResultDType of the shape: the `out` dtype Run writes without a copy.
  DType result_dtype() const;
  // Standard NS's FLOPs: 2*m*m*n + 2*m^3 + 2*m*m*n per step (Gram, A^2,
  // B X), times num_steps, whichever algorithm runs (the benchmarks' "effective
  // NS TFLOP/s" divides this by the time).
  double FlopsPerMatrix() const;
  // The FLOPs the algorithm that runs executes (FlopsPerMatrix for standard
  // NS without use_syrk; GramNewtonSchulz::FlopsPerMatrix for Gram).
  double RunFlopsPerMatrix() const;
  // The Gram NS engine when this shape runs Gram NS, else nullptr.
  const GramNewtonSchulz* gram() const { return gram_.get(); }

 private:
  NewtonSchulz(Backend* backend, NsOptions options, int64_t rows, int64_t cols,
               int64_t max_batch, std::vector<NsCoefficients> schedule);
  absl::Status AllocateWorkspace();
  // c = alpha op(a) op(b) + beta c over `batch` slices with the given
  // per-slice strides (elements); batch 1 is a plain Gemm.
  absl::Status Mm(Op op_a, Op op_b, float alpha, const MatrixView& a,
                  int64_t sa, const MatrixView& b, int64_t sb, float beta,
                  const MatrixView& c, int64_t sc, int64_t batch);
  // d = alpha op(a) op(b) + beta c with d a separate buffer (no copy of c on
  // the CUDA backend; Copy2D + Gemm on the CPU backend, as before).
  absl::Status MmOut(Op op_a, Op op_b, float alpha, const MatrixView& a,
                     int64_t sa, const MatrixView& b, int64_t sb, float beta,
                     const MatrixView& c, int64_t sc, const MatrixView& d,
                     int64_t sd, int64_t batch);
  // A = X X^T (or X^T X when tall): symmetric call, full product or legacy
  // lower-triangle block rows + mirror.
  absl::Status Gram(const MatrixView& x, int64_t sx, const MatrixView& a,
                    int64_t batch);
  // b_out = b*A + c*A*A (b_out preloaded with A).
  absl::Status Poly(const MatrixView& a, float b, float c,
                    const MatrixView& b_out, int64_t batch);

  Backend* backend_;
  NsOptions options_;
  int64_t rows_, cols_, max_batch_;
  int64_t m_, n_;  // m = min(rows, cols), n = max
  bool tall_;
  int block_rows_;  // legacy block rows of Gram/Poly; 0 or 1: none
  bool sym_gram_;   // A through SymmetricGemmStridedBatchedOut
  bool sym_poly_;   // B through SymmetricGemmStridedBatchedOut
  DType work_dtype_;
  std::vector<NsCoefficients> schedule_;
  void* x_[2] = {nullptr, nullptr};         // batch * rows * cols, work dtype
  void* a_ = nullptr;                       // batch * m * m
  void* b_ = nullptr;                       // batch * m * m
  std::unique_ptr<GramNewtonSchulz> gram_;  // set when this shape runs Gram
};

}  // namespace muond
