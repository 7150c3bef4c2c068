#pragma once
// The compute backend interface: everything the Muon/AdamW math needs from a
// device, implemented once for the CPU (OpenBLAS) and once for CUDA
// (cuBLAS + our kernels). core/muon is written only against this interface,
// so the CPU backend is both the no-GPU runtime and the reference the CUDA
// backend is tested against.
//
// Conventions (all calls):
// * Matrices are MatrixViews: row-major, column stride 1, any row_stride >=
//   cols (a TP column block of a row-major matrix is a first-class view, it is
//   never copied to make it contiguous). Where the memory lives (host for the
//   CPU backend, device or mapped memory for CUDA) is the caller's business.
// * Calls are stream-ordered: on CUDA every call is enqueued on the backend's
//   one stream and returns without a host synchronisation, except
//   AllFinite, CopyToHost and Synchronize, which say so. Errors returned are
//   argument errors found on the host (shapes, dtypes, precisions) or launch
//   failures; a failed call has not modified anything.
// * Elementwise math is defined once in core/backend/elementwise_math.h and
//   evaluated without fused multiply-adds on both backends, so the CPU and the
//   CUDA backend give bit-identical elementwise results.
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/common/matrix_view.h"

namespace muond {

// Matmul precision, named after torch.set_float32_matmul_precision (the
// `fp32_matmul_prec` of Emerging-Optimizers / Megatron Muon):
//   kHighest: fp32 operands, fp32 products and accumulation.
//   kHigh:    fp32 operands, TF32 tensor-core products, fp32 accumulation.
//   kMedium:  bf16 operands and outputs, fp32 accumulation (views are bf16).
// The CPU backend implements kHighest and kMedium (not kHigh: no TF32 on CPUs).
enum class MatmulPrecision : int32_t { kHighest = 0, kHigh = 1, kMedium = 2 };
std::string_view MatmulPrecisionName(MatmulPrecision precision);
// "highest", "high" or "medium" (MatmulPrecisionName); InvalidArgument
// "fp32_matmul_prec '<name>' is not highest, high or medium" otherwise.
absl::StatusOr<MatmulPrecision> ParseMatmulPrecision(std::string_view name);

// Whether a GEMM operand is used as stored or transposed.
enum class Op : int32_t { kN = 0, kT = 1 };

// Weight decay of the Muon update (EO mixin.py, dtensor-muon for cautious):
//   kDecoupled:   p <- p - lr*wd*p                  (default)
//   kIndependent: p <- p - wd*p
//   kCautious:    p <- p - lr*wd*p only where update*p > 0, else p unchanged
//   kNone:        no decay
enum class WeightDecayMethod : int32_t {
  kDecoupled = 0,
  kIndependent = 1,
  kCautious = 2,
  kNone = 3,
};
std::string_view WeightDecayMethodName(WeightDecayMethod method);

// Per-step AdamW scalars, computed on the host in double and rounded to fp32
// once, as torch.optim.AdamW (single-tensor path) does with Python floats.
// core/muon/adamw.h builds them from AdamWOptions and the step number.
struct AdamWScalars {
  float param_decay = 1.0f;      // 1 - lr*wd
  float one_minus_beta1 = 0.1f;  // exp_avg.lerp_(grad, 1 - beta1)
  float beta2 = 0.999f;          // exp_avg_sq * beta2
  float one_minus_beta2 = 0.001f;
  float step_size = 1e-3f;  // lr / (1 - beta1^t)   (lr if no correction)
  float bias_correction2_sqrt = 1.0f;  // sqrt(1 - beta2^t) (1 if none)
  float eps = 1e-8f;
};

// Free and total bytes of a backend's memory (Backend::Memory).
struct MemoryInfo {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};

// One matrix of a NorMuon row set (Backend::NorMuonRowStats): its local
// rows of the update, where they sit in the full matrix, where its entries
// are in the set's buffers, and what this rank contributes to the row
// statistics (core/step/variant_phase.h).
struct NorMuonRowBlock {
  MatrixView update;          // local rows x cols, fp32|bf16|fp16
  int64_t row_offset = 0;     // local row 0 in state / staged / factors
  int64_t stats_offset = 0;   // full_rows sums, then full_rows state
  int64_t full_rows = 0;      // of the full matrix
  int64_t full_cols = 0;      // of the full matrix (the mean's divisor)
  int64_t global0 = 0;        // the full row of local row 0
  int64_t valid = 0;          // real local rows (the rest is padding)
  bool adds_sums = false;     // contributes its rows' (partial) sums
  bool speaks_state = false;  // contributes its rows' state
  bool skip = false;          // left alone this step
};

// The fp32 block scales that travel with fp8_e4m3 state
// (core/common/state_storage.h): one per kStateBlock consecutive elements of
// a contiguous state view, `in` of the state read (momentum_in), `out` of the
// state written (momentum_out; `in` itself when in place). Both null for
// fp32 and bf16 state.
struct BlockScales {
  const float* in = nullptr;
  float* out = nullptr;
};

// The block scales of fp8_e4m3 AdamW moments, updated in place with them
// (one fp32 per kStateBlock elements each; exp_avg_sq's scales sqrt(v)'s);
// null for fp32 and bf16 moments.
struct AdamWMomentScales {
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu" or "cuda:<device>".
  virtual std::string_view name() const = 0;
  // True when views must point at device memory.
  virtual bool is_device() const = 0;
  // Whether `precision` exists on this backend (CPU: kHighest, kMedium).
  virtual bool SupportsPrecision(MatmulPrecision precision) const = 0;
  // The cudaStream_t every call is enqueued on (for the NCCL communicator of
  // the same group); nullptr on the CPU backend.
  virtual void* stream() const { return nullptr; }

  // ---- memory -------------------------------------------------------------
  // `bytes` >= 0; the memory is 256-byte aligned and uninitialised. Allocate
  // and Free may synchronise; call them at setup, not inside a step.
  virtual absl::StatusOr<void*> Allocate(int64_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // Host memory the backend's calls read and write in place, as they do
  // Allocate's (state_location host: the optimizer state takes no device
  // memory; the kernels reach it over the bus). CUDA: pinned, mapped and
  // portable (cudaHostAlloc), one address for host and device (unified
  // addressing); CPU: Allocate. Free with FreeHost.
  virtual absl::StatusOr<void*> AllocateHost(int64_t bytes) {
    return Allocate(bytes);
  }
  virtual void FreeHost(void* ptr) { Free(ptr); }
  // The memory Allocate draws from: free and total bytes now (CUDA:
  // cudaMemGetInfo of the device, which other processes share; CPU: the
  // host's available memory, /proc/meminfo MemAvailable). Unimplemented by
  // default (the caller then has no measure: it allocates and sees).
  virtual absl::StatusOr<MemoryInfo> Memory();
  // Sets every element of `view` to +0.
  virtual absl::Status Memset0(const MatrixView& view) = 0;
  // Plain byte copies between host memory and backend memory (Allocate's or
  // AllocateHost's: CUDA copies by address, cudaMemcpyDefault). CopyFromHost
  // may return before the copy ran (the host buffer must stay valid until
  // the next Synchronize); CopyToHost returns after the bytes arrived.
  virtual absl::Status CopyFromHost(void* dst, const void* src,
                                    int64_t bytes) = 0;
  virtual absl::Status CopyToHost(void* dst, const void* src,
                                  int64_t bytes) = 0;
  // dst <- src elementwise for two same-shape strided views of backend
  // memory, converting fp32 <-> bf16 (fp32 -> bf16 rounds to nearest even;
  // bf16 -> fp32 is exact), and fp16 (internal: the Gram NS iteration
  // dtype) to and from both, rounded once to nearest even; fp8 only to fp8
  // (CheckCopy). The views must not overlap unless identical.
  virtual absl::Status Copy2D(const MatrixView& dst, const MatrixView& src) = 0;

  // ---- matmul -------------------------------------------------------------
  // c <- alpha * op(a) op(b) + beta * c, with op(a) m x k, op(b) k x n and c
  // m x n (shapes taken from the views; a view of a transposed operand has
  // the stored shape). beta == 0 never reads c (NaN in c does not leak).
  // dtypes: kHighest/kHigh need fp32 a, b, c; kMedium needs bf16 a, b, c or
  // fp16 a, b, c (fp32 accumulation either way).
  // c must not overlap a or b.
  virtual absl::Status Gemm(Op op_a, Op op_b, float alpha, const MatrixView& a,
                            const MatrixView& b, float beta,
                            const MatrixView& c, MatmulPrecision precision) = 0;
  // The same for `batch` problems; slice i of x is the view x with `data`
  // advanced by i * stride_x elements (stride_x >= span of one slice).
  virtual absl::Status GemmStridedBatched(Op op_a, Op op_b, float alpha,
                                          const MatrixView& a, int64_t stride_a,
                                          const MatrixView& b, int64_t stride_b,
                                          float beta, const MatrixView& c,
                                          int64_t stride_c, int64_t batch,
                                          MatmulPrecision precision) = 0;
  // d <- alpha * op(a) op(b) + beta * c with a separate output d of c's shape
  // and dtype: c is only read (beta == 0 never reads it) and may be any view
  // of that shape. d must not overlap a, b or c (d == c, the same view, is
  // the in-place Gemm). The default, used by the CPU backend, is
  // Copy2D(d, c) followed by Gemm into d (bitwise that sequence); the CUDA
  // backend writes D directly (cublasLt, no copy).
  virtual absl::Status GemmOut(Op op_a, Op op_b, float alpha,
                               const MatrixView& a, const MatrixView& b,
                               float beta, const MatrixView& c,
                               const MatrixView& d, MatmulPrecision precision);
  // The same for `batch` problems (slice i of x = x advanced by i*stride_x).
  virtual absl::Status GemmStridedBatchedOut(
      Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
      const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
      int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
      MatmulPrecision precision);
  // d <- alpha * op(a) op(b) + beta * c for products the caller knows are
  // symmetric (X X^T, X^T X, or products of commuting symmetric matrices
  // such as polynomials in one Gram matrix), with c symmetric (or beta ==
  // 0): only the lower triangle is computed and the upper is written as its
  // mirror, so d is exactly symmetric. Shapes, strides and dtypes as
  // GemmStridedBatchedOut (d square). The default is GemmStridedBatchedOut
  // followed by SymmetrizeFromLower(d) (CPU); CUDA runs muond's Hopper
  // symmetric GEMM on sm_90 above a measured size and cuBLASLt below it
  // (core/backend/sym_gemm_sm90.h).
  virtual absl::Status SymmetricGemmStridedBatchedOut(
      Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
      const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
      int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
      MatmulPrecision precision);
  // Adds `value` to the diagonal of each square slice (slice i is `view`
  // advanced by i * stride elements): x_jj <- x_jj + value computed in fp32
  // and stored in the view's dtype (fp32, bf16 or fp16) with one rounding.
  // Gram Newton–Schulz's Q = Z + a I (core/muon/gram_newton_schulz.h).
  virtual absl::Status AddToDiagonal(const MatrixView& view, int64_t stride,
                                     int64_t batch, float value) = 0;
  // True where SymmetricGemmStridedBatchedOut runs a lower-triangle kernel
  // that beats GemmStridedBatchedOut for a batch of `batch` n x n results of
  // inner dimension k in `dtype` (contiguous row-major operands); false
  // (default) where it is the full product plus the mirror or not faster.
  // Callers whose products are symmetric anyway use it to pick the call; a
  // caller that runs batches of varying size passes its largest and keeps
  // the answer for all of them (a batch of one then takes the batched path).
  virtual bool FastSymmetricGemm(int64_t /*n*/, int64_t /*k*/, DType /*dtype*/,
                                 int64_t /*batch*/) const {
    return false;
  }
  // Mirrors the lower triangle (diagonal included) of each square slice into
  // its upper triangle: slice i is `a` advanced by i * stride elements.
  virtual absl::Status SymmetrizeFromLower(const MatrixView& a, int64_t stride,
                                           int64_t batch) = 0;

  // ---- Newton–Schulz input ------------------------------------------------
  // src (fp32 or bf16) holds `batch` matrices stacked along rows (src.rows
  // divisible by batch). For each slice: dst = src / max(||src||_F, eps), the
  // F.normalize(x, p=2, dim=(-2,-1), eps) of Emerging-Optimizers. The sum of
  // squares is accumulated in fp64 (tiny inputs such as 1e-30 * I do not
  // underflow), the norm rounded to fp32, the division done in fp32; dst is
  // fp32, bf16 or fp16 (rounded once; fp16 is Gram NS's iteration dtype). No
  // host synchronisation on CUDA. dst may equal src; it must not otherwise
  // overlap it.
  virtual absl::Status FrobeniusNormalize(const MatrixView& src,
                                          const MatrixView& dst, int64_t batch,
                                          float eps) = 0;

  // ---- elementwise (formulas in elementwise_math.h) ------------------------
  // Muon momentum (EMA form of EO / torch.optim.Muon); the weights float(beta)
  // and float(1 - beta) are formed from the double `beta` on the host:
  //   momentum_out <- lerp(momentum_in, grad, 1 - beta) = m + (1-beta)(g - m)
  //   out          <- nesterov ? lerp(grad, momentum_out, beta)
  //                            = g + beta(m' - g) : momentum_out
  // grad fp32|bf16|fp16, momentum_in / momentum_out fp32|bf16|fp8_e4m3
  // (state, both of one dtype), out fp32|bf16 (the Newton–Schulz input in
  // the NS work dtype, rounded once). Same shapes. bf16 state: `out` sees the
  // stored (rounded) momentum. fp8_e4m3 state (contiguous, `scales` given):
  // each block of kStateBlock consecutive elements is dequantized with its
  // scale (ew::DequantizeE4M3), the new momentum computed in fp32 as above,
  // `out` formed from that unquantized value, and the block stored as codes
  // and scales.out (ew::BlockScale of its absmax, ew::QuantizeE4M3).
  // momentum_out may be momentum_in (in place, scales.out == scales.in);
  // otherwise it must not overlap momentum_in, grad or out. Either output
  // may be Absent (matrix_view.h), not both: the step engine computes out
  // with momentum_out absent (the state only read, so an abandoned step
  // leaves it untouched with no copy of it), then after the commit vote
  // stores the new momentum by the same kernel in place with out absent:
  // the same math on the same values, so bitwise the one full call
  // (fp8: scales.out unused while momentum_out is absent). out never
  // overlaps either momentum (the NS input is never state).
  virtual absl::Status MuonMomentum(const MatrixView& grad,
                                    const MatrixView& momentum_in,
                                    const MatrixView& momentum_out, double beta,
                                    bool nesterov, const MatrixView& out,
                                    const BlockScales& scales) = 0;
  // fp32 or bf16 state (no scales).
  absl::Status MuonMomentum(const MatrixView& grad,
                            const MatrixView& momentum_in,
                            const MatrixView& momentum_out, double beta,
                            bool nesterov, const MatrixView& out) {
    return MuonMomentum(grad, momentum_in, momentum_out, beta, nesterov, out,
                        BlockScales{});
  }
  // In place: momentum is read and overwritten.
  absl::Status MuonMomentum(const MatrixView& grad, const MatrixView& momentum,
                            double beta, bool nesterov, const MatrixView& out) {
    return MuonMomentum(grad, momentum, momentum, beta, nesterov, out);
  }
  // MuonMomentum for n params at once (grads[i], momenta_in[i],
  // momenta_out[i], outs[i], scales[i]; the spans have the same length, or
  // scales is empty: no fp8 state). Bitwise the n single calls, which is the
  // default; CUDA batches small contiguous tensors into few launches (fp8
  // state: one CTA per state block, any tensor).
  virtual absl::Status MuonMomentumBatch(
      absl::Span<const MatrixView> grads,
      absl::Span<const MatrixView> momenta_in,
      absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
      absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales);
  absl::Status MuonMomentumBatch(absl::Span<const MatrixView> grads,
                                 absl::Span<const MatrixView> momenta_in,
                                 absl::Span<const MatrixView> momenta_out,
                                 double beta, bool nesterov,
                                 absl::Span<const MatrixView> outs) {
    return MuonMomentumBatch(grads, momenta_in, momenta_out, beta, nesterov,
                             outs, {});
  }
  // In place.
  absl::Status MuonMomentumBatch(absl::Span<const MatrixView> grads,
                                 absl::Span<const MatrixView> momenta,
                                 double beta, bool nesterov,
                                 absl::Span<const MatrixView> outs) {
    return MuonMomentumBatch(grads, momenta, momenta, beta, nesterov, outs);
  }
  // MuonMomentumBatch that also checks every grad it reads (no NaN or +-Inf,
  // |g| < grad_limit: AllFiniteBelow's test) for TakeGradChecks, so the
  // step's "every gradient is finite" vote costs no read of its own. Bitwise
  // MuonMomentumBatch's outputs. The finding goes to check slot `slot`
  // (0 <= slot < grad_check_slots()): the step engine gives each group a slot
  // and takes every group's finding with one wait. The default runs
  // AllFiniteBelow, then MuonMomentumBatch; CUDA compares in the momentum
  // kernels as they load.
  virtual absl::Status CheckedMuonMomentumBatch(
      absl::Span<const MatrixView> grads,
      absl::Span<const MatrixView> momenta_in,
      absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
      absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales,
      float grad_limit, int slot);
  // AllFiniteBelow's test of `views` against `limit` into check slot `slot`,
  // for TakeGradChecks: CUDA issues the check and returns (a group without a
  // checked momentum, such as AdamW, waits with the others); the default
  // runs AllFiniteBelow.
  virtual absl::Status CheckGradsInto(absl::Span<const MatrixView> views,
                                      float limit, int slot);
  // How many check slots CheckedMuonMomentumBatch and CheckGradsInto may
  // write before a TakeGradChecks.
  virtual int grad_check_slots() const { return kDefaultGradCheckSlots; }
  // For slots [0, `slots`): whether every grad the CheckedMuonMomentumBatch
  // and CheckGradsInto calls into that slot read since the last take was
  // within its limit (true for a slot no call wrote); those slots start
  // afresh. CUDA waits once for those calls' kernels; the default's findings
  // are its AllFiniteBelow's, which waited already.
  virtual absl::StatusOr<std::vector<bool>> TakeGradChecks(int slots);
  static constexpr int kDefaultGradCheckSlots = 1024;
  // Weight decay then p <- p - lr * update, computed in fp32 and stored in
  // the param's dtype (fp32, bf16 or fp16) with one rounding. update is fp32,
  // bf16 or fp16 (the Newton–Schulz output, unscaled: `lr` is the adjusted lr,
  // the base lr times the Muon scale, as torch.optim.Muon's adjusted_lr).
  // `decay` is the decay factor already resolved by the caller
  // (lr*wd for decoupled/cautious, wd for independent; ignored for kNone).
  virtual absl::Status ApplyUpdate(const MatrixView& param,
                                   const MatrixView& update, float lr,
                                   float decay, WeightDecayMethod method) = 0;
  // ApplyUpdate for n params at once (params[i], updates[i], lrs[i]: each
  // param's adjusted lr; one shared decay); bitwise the n single calls (the
  // default), batched into few launches on CUDA.
  virtual absl::Status ApplyUpdateBatch(absl::Span<const MatrixView> params,
                                        absl::Span<const MatrixView> updates,
                                        absl::Span<const float> lrs,
                                        float decay, WeightDecayMethod method);
  // ApplyUpdateBatch with each update row scaled on the way: param k's
  // element (i, j) gets ew::UpdateParam(p, u_ij * row_factors[k][i], ...),
  // the product in fp32, not rounded to the update's dtype (NorMuon's row
  // normalisation, applied with the update: core/step/variant_phase.h).
  // row_factors[k]: fp32 rows x 1.
  virtual absl::Status ApplyRowScaledUpdateBatch(
      absl::Span<const MatrixView> params, absl::Span<const MatrixView> updates,
      absl::Span<const MatrixView> row_factors, absl::Span<const float> lrs,
      float decay, WeightDecayMethod method);
  // Fused AdamW, torch.optim.AdamW single-tensor order:
  //   p *= param_decay; m = lerp(m, g, 1-beta1); v = v*beta2 + (1-beta2)*g*g;
  //   p += -step_size * m / (sqrt(v) / bias_correction2_sqrt + eps).
  // param fp32|bf16|fp16 (one rounding), grad fp32|bf16|fp16,
  // exp_avg/exp_avg_sq fp32, bf16 or fp8_e4m3, both of one dtype: computed in
  // fp32 and stored rounded to nearest even (bf16, as torch keeps a bf16
  // param's moments) or, fp8 (contiguous, `scales` given: torchao's
  // AdamWFp8), blockwise as MuonMomentum's fp8 state: each block of
  // kStateBlock elements dequantized, stepped in fp32 (the param from the
  // unquantized new moments), each moment's block stored as codes and a
  // scale of its own absmax; exp_avg_sq's codes and scale hold sqrt(v)
  // (ew::SecondMomentRoot: a small v would flush to 0 under its linear
  // code while m survives). Updated in place.
  virtual absl::Status AdamW(const MatrixView& param, const MatrixView& grad,
                             const MatrixView& exp_avg,
                             const MatrixView& exp_avg_sq,
                             const AdamWScalars& scalars,
                             const AdamWMomentScales& scales) = 0;
  // fp32 or bf16 moments (no scales).
  absl::Status AdamW(const MatrixView& param, const MatrixView& grad,
                     const MatrixView& exp_avg, const MatrixView& exp_avg_sq,
                     const AdamWScalars& scalars) {
    return AdamW(param, grad, exp_avg, exp_avg_sq, scalars,
                 AdamWMomentScales{});
  }

  // ---- Muon variants (core/muon/muon_variant.h) ---------------------------
  // NorMuon over a set of matrices (one call for a whole param group): the
  // per-row buffers `state`, `staged` and `factors` are fp32 (sum of the
  // blocks' local rows) x 1, block k's rows from its row_offset; `stats` is
  // fp32 slots x 1, block k's full rows of row sums then of state from its
  // stats_offset (NorMuonRowBlock).
  //
  // stats <- zeros, then each block's contribution: for each real local row
  // r (r < valid) at full row R = global0 + r,
  //   adds_sums:    stats[stats_offset + R] = sum_j update_rj^2, in fp64 in
  //                 a fixed order (a function of the columns alone on a
  //                 backend; the CPU sums left to right), rounded once;
  //   speaks_state: stats[stats_offset + full_rows + R] = state[row_offset+r].
  virtual absl::Status NorMuonRowStats(absl::Span<const NorMuonRowBlock> blocks,
                                       const MatrixView& state,
                                       const MatrixView& stats);
  // out[k] <- slices[0, k] + slices[1, k] + ... in fp32, in row order (the
  // ranks' contributions after an all_gather). slices: fp32 n x slots, out:
  // fp32 slots x 1 (may not overlap slices).
  virtual absl::Status SumSlices(const MatrixView& slices,
                                 const MatrixView& out);
  // From the complete `stats` of every block's full rows: each real local row
  // of a block not skipped gets NorMuon's factor (ew::NorMuonRowState /
  // ew::NorMuonDenom; the two sums over the full rows in fp64, in a fixed
  // order: the CPU's row order) in `factors` and its new state in `staged`;
  // every other local row factor 1 and its state (staged = state). The
  // update is not touched: ApplyRowScaledUpdateBatch applies the factors.
  // `staged` may be `state` (in place).
  virtual absl::Status NorMuonFactors(absl::Span<const NorMuonRowBlock> blocks,
                                      const MatrixView& stats,
                                      const MatrixView& state,
                                      const MatrixView& staged,
                                      const MatrixView& factors, double beta2,
                                      double eps);
  // AdaMuon on the unscaled update u (fp32|bf16|fp16) with its second moment
  // (fp32, u's shape), ew::AdaMuonElement: v_out <- lerp(v_in, u*u,
  // 1 - beta2); u <- u / (sqrt(v_out) + eps). v_out may be v_in (in place)
  // or overlap nothing (the step engine stages it, as momentum).
  virtual absl::Status AdaMuonNormalize(const MatrixView& update,
                                        const MatrixView& v_in,
                                        const MatrixView& v_out, double beta2,
                                        float eps);
  // AdaMuonNormalize for n updates at once; bitwise the n single calls (the
  // default), batched into few launches on CUDA.
  virtual absl::Status AdaMuonNormalizeBatch(
      absl::Span<const MatrixView> updates, absl::Span<const MatrixView> v_in,
      absl::Span<const MatrixView> v_out, double beta2, float eps);

  // ---- checks and sync ----------------------------------------------------
  // True when every element x of every view has |x| < limit (so none is NaN
  // or +-Inf; limit = +inf is the plain finiteness check, limit =
  // kBf16OverflowThreshold also rejects fp32 values that round to inf in
  // bf16). One read of the views; synchronises once (all views are checked
  // before the one device-to-host read).
  virtual absl::StatusOr<bool> AllFiniteBelow(
      absl::Span<const MatrixView> views, float limit) = 0;
  // AllFiniteBelow with limit +inf: no NaN or +-Inf.
  absl::StatusOr<bool> AllFinite(absl::Span<const MatrixView> views) {
    return AllFiniteBelow(views, std::numeric_limits<float>::infinity());
  }
  // Waits for every call enqueued so far.
  virtual absl::Status Synchronize() = 0;

  // ---- timing without waiting ----------------------------------------------
  // A mark of the point this backend's queue has reached (CUDA: an event
  // recorded on the stream), so that phases of work are timed without a
  // host wait after each (core/step/phase_clock.h): MarkedUs(from, to) is
  // the device time between two marks, once Synchronize returned after both.
  // ClearTimeMarks lets later marks reuse the earlier ones' slots. The
  // default (the CPU backend, whose calls return with their work done, and
  // any backend without marks): Unimplemented, and callers time the wall
  // clock instead.
  virtual absl::StatusOr<int> TimeMark() {
    return absl::UnimplementedError(
        absl::StrCat(std::string(name()), " has no time marks"));
  }
  virtual absl::StatusOr<double> MarkedUs(int from, int to) {
    (void)from;
    (void)to;
    return absl::UnimplementedError(
        absl::StrCat(std::string(name()), " has no time marks"));
  }
  virtual void ClearTimeMarks() {}

  // ---- streams --------------------------------------------------------------
  // A backend of the same device with a queue of its own (CUDA: a stream),
  // for copies and elementwise calls (no GEMM: on CUDA it holds no cuBLAS
  // memory), whose calls run concurrently with this one's except where
  // OrderBefore orders them; memory of either is valid on both. The CPU
  // backend, which runs every call at once, has none (Unimplemented).
  virtual absl::StatusOr<std::unique_ptr<Backend>> NewStream() {
    return absl::UnimplementedError(
        absl::StrCat(std::string(name()), " has no concurrent streams"));
  }
  // The calls enqueued on this backend so far happen before those enqueued
  // on `later` after this call (CUDA: an event recorded on this stream that
  // `later`'s stream waits for); host-side, it does not wait. A no-op
  // where calls run at once (CPU).
  virtual absl::Status OrderBefore(Backend& later) {
    (void)later;
    return absl::OkStatus();
  }

  // ---- CUDA graphs --------------------------------------------------------
  // Runs `work` (calls on this backend only, no host synchronisation, no
  // Allocate/Free) as one replay of a graph captured the first time `key` was
  // seen: on CUDA the stream is captured into a cudaGraphExec cached under
  // `key` and replayed. A replay repeats the captured calls with the pointers,
  // shapes, strides, dtypes and scalars they had at capture (the data behind
  // the pointers is read fresh), so the caller's key must cover every one of
  // them, and the memory must outlive the key's use. A capture failure falls
  // back to running `work` directly and is not retried for that key; `work`
  // may then run twice on the host (once captured, once for real), so its
  // host side effects must be idempotent. A RunGraph inside another's work
  // is part of the outer graph. The default (CPU) runs `work`.
  virtual absl::Status RunGraph(uint64_t key,
                                const std::function<absl::Status()>& work) {
    (void)key;
    return work();
  }

  // ---- tracing --------------------------------------------------------------
  // Named ranges around the phases of a step (NVTX on CUDA, so Nsight Systems
  // shows lsmuon/momentum, a2a_fwd, ns, a2a_bwd, update); no-ops elsewhere.
  // Ranges nest; every Push has a Pop on the same thread.
  virtual void PushRange(const char* name) { (void)name; }
  virtual void PopRange() {}

 private:
  // The default CheckGradsInto's findings by slot (true: a grad out of
  // range), for TakeGradChecks.
  std::vector<bool> checked_grads_out_of_range_;
};

// ---- argument checks shared by the implementations ------------------------
// Each returns InvalidArgument naming `what` and the rule broken.
absl::Status CheckView(const MatrixView& v, std::string_view what);
absl::Status CheckSameShape(const MatrixView& a, const MatrixView& b,
                            std::string_view what_a, std::string_view what_b);
absl::Status CheckDType(const MatrixView& v, DType dtype,
                        std::string_view what);
// Copy2D's rule: same shapes (CheckSameShape), and a conversion only between
// fp32, bf16 and fp16; fp8 e4m3 views copy only into fp8 (its block scales
// are not the views': state_io quantises them).
absl::Status CheckCopy(const MatrixView& dst, const MatrixView& src);
// Checks a Gemm call's shapes and dtypes against `precision`.
absl::Status CheckGemm(Op op_a, Op op_b, const MatrixView& a,
                       const MatrixView& b, const MatrixView& c,
                       MatmulPrecision precision);
// Checks AddToDiagonal's arguments (square slices, batch >= 0).
absl::Status CheckAddToDiagonal(const MatrixView& view, int64_t batch);
// Checks FrobeniusNormalize's arguments.
absl::Status CheckNormalize(const MatrixView& src, const MatrixView& dst,
                            int64_t batch, float eps);
// Checks MuonMomentum's / ApplyUpdate's / AdamW's arguments.
absl::Status CheckMomentum(const MatrixView& grad,
                           const MatrixView& momentum_in,
                           const MatrixView& momentum_out,
                           const MatrixView& out,
                           const BlockScales& scales = {});
// CheckedMuonMomentumBatch's slot is in [0, count); TakeGradChecks' `slots`
// in [1, count].
absl::Status CheckGradCheckSlot(int slot, int count);
absl::Status CheckGradCheckSlots(int slots, int count);
// The four spans of MuonMomentumBatch have the same length; scales has it
// too or is empty.
absl::Status CheckMomentumBatch(absl::Span<const MatrixView> grads,
                                absl::Span<const MatrixView> momenta_in,
                                absl::Span<const MatrixView> momenta_out,
                                absl::Span<const MatrixView> outs,
                                absl::Span<const BlockScales> scales = {});
// Checks a NorMuon row set against its buffers (NorMuonRowStats /
// NorMuonFactors); `staged` and `factors` may be empty views (not checked).
absl::Status CheckNorMuonBlocks(absl::Span<const NorMuonRowBlock> blocks,
                                const MatrixView& state,
                                const MatrixView& stats,
                                const MatrixView& staged,
                                const MatrixView& factors);
absl::Status CheckSumSlices(const MatrixView& slices, const MatrixView& out);
// Checks AdaMuonNormalize's arguments.
absl::Status CheckAdaMuon(const MatrixView& update, const MatrixView& v_in,
                          const MatrixView& v_out);
absl::Status CheckAdaMuonBatch(absl::Span<const MatrixView> updates,
                               absl::Span<const MatrixView> v_in,
                               absl::Span<const MatrixView> v_out);
absl::Status CheckUpdate(const MatrixView& param, const MatrixView& update);
absl::Status CheckUpdateBatch(absl::Span<const MatrixView> params,
                              absl::Span<const MatrixView> updates,
                              absl::Span<const float> lrs);
// CheckUpdateBatch and every row_factors[k] fp32 params[k].rows x 1.
absl::Status CheckRowScaledUpdateBatch(absl::Span<const MatrixView> params,
                                       absl::Span<const MatrixView> updates,
                                       absl::Span<const MatrixView> row_factors,
                                       absl::Span<const float> lrs);
absl::Status CheckAdamW(const MatrixView& param, const MatrixView& grad,
                        const MatrixView& exp_avg, const MatrixView& exp_avg_sq,
                        const AdamWMomentScales& scales = {});

}  // namespace muond
