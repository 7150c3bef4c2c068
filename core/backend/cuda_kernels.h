#pragma once
// Launchers of muond's own CUDA kernels (the non-GEMM half of the CUDA
// backend). Plain header: the .cu side sees no absl. Every launcher enqueues
// on `stream`, never synchronises, and returns the launch's cudaError_t.
// Arguments are assumed validated by CudaBackend (core/backend/backend.h
// documents the semantics; the elementwise formulas are those of
// core/backend/elementwise_math.h).
#include <cuda_runtime.h>

#include <cstdint>

namespace muond {
namespace cuda_kernels {

// A row-major strided matrix as the kernels see it (the backend converts
// MatrixView; kept separate so nvcc needs no project header beyond this).
struct KView {
  void* data;
  int64_t rows, cols;
  int64_t ld;  // elements between row starts, >= cols
  int elem;    // bytes per element: 4 fp32, 2 bf16 or fp16, 1 fp8 e4m3
  // A 2-byte element is fp16 (the Gram NS iteration dtype), not bf16.
  bool f16 = false;
};

// Scratch doubles for the Frobenius-norm partial sums (up to 1024 blocks per
// slice, fewer for large batches: kNormPartials / batch, at least 64);
// batches are split into chunks of kNormBatchChunk slices.
constexpr int64_t kNormPartials = 64 * 4096;
constexpr int64_t kNormBatchChunk = 4096;

// The grad check the momentum kernels make as they load each grad element:
// an element that is NaN, +-Inf or has |g| >= limit sets *flag to 1 (the
// step engine's "every gradient is finite" vote, read in the momentum's own
// pass over the grads). A null flag: no check.
struct GradCheck {
  float limit = 0.0f;
  int* flag = nullptr;
};

cudaError_t Copy2DConvert(const KView& dst, const KView& src,
                          cudaStream_t stream);
cudaError_t SymmetrizeFromLower(const KView& a, int64_t stride, int64_t batch,
                                cudaStream_t stream);
// dst slices = src slices / max(||slice||_F, eps); `batch` <= kNormBatchChunk,
// `partials` holds kNormPartials doubles of scratch.
cudaError_t FrobeniusNormalize(const KView& src, const KView& dst,
                               int64_t batch, float eps, double* partials,
                               cudaStream_t stream);
// momentum_out may be momentum_in (in place) or overlap nothing.
cudaError_t MuonMomentum(const KView& grad, const KView& momentum_in,
                         const KView& momentum_out, float one_minus_beta,
                         float beta, bool nesterov, const KView& out,
                         cudaStream_t stream, GradCheck check = {});
cudaError_t ApplyUpdate(const KView& param, const KView& update, float lr,
                        float decay, int method, cudaStream_t stream);
// ApplyUpdate with update row i times factors[i] (fp32, param.rows).
cudaError_t ApplyRowScaledUpdate(const KView& param, const KView& update,
                                 const float* factors, float lr, float decay,
                                 int method, cudaStream_t stream);
cudaError_t AdamW(const KView& param, const KView& grad, const KView& exp_avg,
                  const KView& exp_avg_sq, float param_decay,
                  float one_minus_beta1, float beta2, float one_minus_beta2,
                  float step_size, float bc2_sqrt, float eps,
                  cudaStream_t stream);
// AdamW on fp8 e4m3 moments (contiguous codes, their block scales; updated
// in place), one CTA per block of kStateBlock elements
// (cuda_state_kernels.cu).
cudaError_t AdamWFp8(const KView& param, const KView& grad, void* exp_avg,
                     void* exp_avg_sq, float* exp_avg_scales,
                     float* exp_avg_sq_scales, float param_decay,
                     float one_minus_beta1, float beta2, float one_minus_beta2,
                     float step_size, float bc2_sqrt, float eps,
                     cudaStream_t stream);
// Muon variants (cuda_variant_kernels.cu). A NorMuon row block as the
// kernels see it (core/backend/backend.h NorMuonRowBlock).
struct KRowBlock {
  KView update;
  int64_t row_offset, stats_offset, full_rows, full_cols, global0, valid;
  bool adds_sums, speaks_state, skip;
};
// stats (fp32, `slots` entries) <- zeros, then the blocks' contributions.
cudaError_t NorMuonRowStats(const KRowBlock* blocks, int64_t count,
                            const float* state, float* stats, int64_t slots,
                            cudaStream_t stream);
// out[k] <- sum over r < n, in order, of slices[r * slots + k].
cudaError_t SumSlices(const float* slices, int64_t n, int64_t slots, float* out,
                      cudaStream_t stream);
// Every block's row factors and staged state (the update is not touched).
cudaError_t NorMuonFactors(const KRowBlock* blocks, int64_t count,
                           const float* stats, const float* state,
                           float* staged, float* factors, float one_minus_beta2,
                           double eps, cudaStream_t stream);
// v_out may be v_in (in place) or overlap nothing.
cudaError_t AdaMuonNormalize(const KView& update, const KView& v_in,
                             const KView& v_out, float one_minus_beta2,
                             float eps, cudaStream_t stream);
// Sets *flag = 1 (device int) when `v` holds an x with !(|x| < limit): a NaN,
// an Inf, or a value at or beyond `limit`.
cudaError_t MarkNonFinite(const KView& v, float limit, int* flag,
                          cudaStream_t stream);

// Multi-tensor forms of the above for `count` same-op tensors (one launch per
// up to kMultiMaxTensors contiguous tensors of < kMultiMaxElems elements, a
// pointer table passed as a kernel argument: nothing is uploaded; any other
// tensor, and any with an fp16 view but the update's, gets its own launch).
// Per-element math identical to the single forms, so the results are bitwise
// the same.
constexpr int kMultiMaxTensors = 40;
constexpr int64_t kMultiMaxElems = int64_t(1) << 31;
cudaError_t MuonMomentumMulti(const KView* grads, const KView* moms_in,
                              const KView* moms_out, const KView* outs,
                              int64_t count, float one_minus_beta, float beta,
                              bool nesterov, cudaStream_t stream,
                              GradCheck check = {});
// MuonMomentumMulti on fp8 e4m3 state (cuda_state_kernels.cu): moms_in /
// moms_out contiguous codes (1-byte KViews) with their block scales
// (scales_in[i] may be scales_out[i]: in place); grads and outs any strides.
// One warp per block of kStateBlock elements (vector loads where contiguous),
// up to 24 tensors per launch.
cudaError_t MuonMomentumFp8Multi(const KView* grads, const KView* moms_in,
                                 const KView* moms_out, const KView* outs,
                                 const float* const* scales_in,
                                 float* const* scales_out, int64_t count,
                                 float one_minus_beta, float beta,
                                 bool nesterov, cudaStream_t stream,
                                 GradCheck check = {});
// lrs[i]: tensor i's (adjusted) lr.
cudaError_t ApplyUpdateMulti(const KView* params, const KView* updates,
                             const float* lrs, int64_t count, float decay,
                             int method, cudaStream_t stream);
// factors[i]: tensor i's row factors (ApplyRowScaledUpdate).
cudaError_t ApplyRowScaledUpdateMulti(const KView* params, const KView* updates,
                                      const float* const* factors,
                                      const float* lrs, int64_t count,
                                      float decay, int method,
                                      cudaStream_t stream);
cudaError_t MarkNonFiniteMulti(const KView* views, int64_t count, float limit,
                               int* flag, cudaStream_t stream);
cudaError_t AdaMuonNormalizeMulti(const KView* updates, const KView* v_in,
                                  const KView* v_out, int64_t count,
                                  float one_minus_beta2, float eps,
                                  cudaStream_t stream);

}  // namespace cuda_kernels
}  // namespace muond
