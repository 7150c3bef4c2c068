// Optimizer steps on fp8 e4m3 state: Muon momentum (MuonMomentumFp8Multi,
// many tensors per launch) and AdamW (AdamWFp8). One CTA per state block of
// kStateBlock consecutive elements, so a block's absmax is a reduction
// inside the CTA. The per-element math and the codec are elementwise_math.h's,
// as on the CPU backend, so both give the same bits.
#include <cstdint>

#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"
#include "core/common/state_storage.h"

namespace muond {
namespace cuda_kernels {
namespace {

static_assert(kStateBlock == kThreads, "one thread per element of a block");

// Up to kFp8MaxTensors tensors per launch, by value in the kernel arguments
// (< 4 KB). CTA b works on tensor k with block_start[k] <= b <
// block_start[k + 1], state block b - block_start[k] of it.
constexpr int kFp8MaxTensors = 24;
struct Fp8Table {
  KView grad[kFp8MaxTensors], out[kFp8MaxTensors];
  const uint8_t* codes_in[kFp8MaxTensors];
  uint8_t* codes_out[kFp8MaxTensors];
  const float* scales_in[kFp8MaxTensors];
  float* scales_out[kFp8MaxTensors];
  int block_start[kFp8MaxTensors + 1];
  int count;
};

__device__ DView DeviceView(const KView& v) {
  return DView{static_cast<char*>(v.data), v.rows, v.cols, v.ld, v.elem, v.f16};
}

// The block's ew::AbsMaxStep fold: max of |v|, NaN if any is NaN (order-
// independent, so the tree gives the sequential fold's value).
__device__ float BlockAbsMax(float v) {
  __shared__ float warp_max[kStateBlock / 32];
  float a = ew::AbsMaxStep(0.0f, v);
  for (int offset = 16; offset > 0; offset /= 2) {
    a = ew::AbsMaxStep(a, __shfl_xor_sync(0xffffffffu, a, offset));
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = a;
  __syncthreads();
  a = 0.0f;
  for (int w = 0; w < kStateBlock / 32; ++w) a = ew::AbsMaxStep(a, warp_max[w]);
  __syncthreads();  // warp_max is free for the next reduction
  return a;
}

__global__ void MomentumFp8Kernel(Fp8Table t, float w_ema, float w_nesterov,
                                  bool nesterov) {
  const int k = EntryOfBlock(t.block_start, t.count, blockIdx.x);
  const DView grad = DeviceView(t.grad[k]), out = DeviceView(t.out[k]);
  const int64_t b = int64_t(blockIdx.x) - t.block_start[k];
  const int64_t e = b * kStateBlock + threadIdx.x;
  const bool live = e < grad.rows * grad.cols;
  // Every read (codes and scale in) happens before BlockAbsMax's barrier,
  // every write after it: in place is safe.
  float m_new = 0.0f;
  if (live) {
    const int64_t i = e / grad.cols, j = e % grad.cols;
    const float g = Ld(grad, i, j);
    const float m = ew::DequantizeE4M3(t.codes_in[k][e], t.scales_in[k][b]);
    m_new = ew::MomentumEma(m, g, w_ema);
    St(out, i, j, nesterov ? ew::NesterovInput(g, m_new, w_nesterov) : m_new);
  }
  const float scale = ew::BlockScale(BlockAbsMax(m_new));
  if (live) t.codes_out[k][e] = ew::QuantizeE4M3(m_new, scale);
  if (threadIdx.x == 0) t.scales_out[k][b] = scale;
}

struct AdamWFp8Args {
  KView param, grad;
  uint8_t *m_codes, *v_codes;
  float *m_scales, *v_scales;
  float param_decay, omb1, beta2, omb2, step_size, bc2, eps;
};

// Both moments' codes and scales are read before the first barrier, written
// after the last. exp_avg_sq's codes hold its square root
// (ew::SecondMomentRoot).
__global__ void AdamWFp8Kernel(AdamWFp8Args a) {
  const DView param = DeviceView(a.param), grad = DeviceView(a.grad);
  const int64_t b = blockIdx.x;
  const int64_t e = b * kStateBlock + threadIdx.x;
  const bool live = e < param.rows * param.cols;
  ew::AdamWOut o{0.0f, 0.0f, 0.0f};
  if (live) {
    const int64_t i = e / param.cols, j = e % param.cols;
    o = ew::AdamWElement(
        Ld(param, i, j), Ld(grad, i, j),
        ew::DequantizeE4M3(a.m_codes[e], a.m_scales[b]),
        ew::DequantizeSecondMoment(a.v_codes[e], a.v_scales[b]), a.param_decay,
        a.omb1, a.beta2, a.omb2, a.step_size, a.bc2, a.eps);
    St(param, i, j, o.p);
  }
  const float v_root = ew::SecondMomentRoot(o.v);
  const float m_scale = ew::BlockScale(BlockAbsMax(o.m));
  const float v_scale = ew::BlockScale(BlockAbsMax(v_root));
  if (live) {
    a.m_codes[e] = ew::QuantizeE4M3(o.m, m_scale);
    a.v_codes[e] = ew::QuantizeSecondMomentRoot(v_root, v_scale);
  }
  if (threadIdx.x == 0) {
    a.m_scales[b] = m_scale;
    a.v_scales[b] = v_scale;
  }
}

cudaError_t Launch(const Fp8Table& t, float w_ema, float w_nesterov,
                   bool nesterov, cudaStream_t stream) {
  if (t.count == 0) return cudaSuccess;
  MomentumFp8Kernel<<<unsigned(t.block_start[t.count]), kStateBlock, 0,
                      stream>>>(t, w_ema, w_nesterov, nesterov);
  return cudaGetLastError();
}

}  // namespace

cudaError_t MuonMomentumFp8Multi(const KView* grads, const KView* moms_in,
                                 const KView* moms_out, const KView* outs,
                                 const float* const* scales_in,
                                 float* const* scales_out, int64_t count,
                                 float one_minus_beta, float beta,
                                 bool nesterov, cudaStream_t stream) {
  // A launch's grid stays below 2^31 CTAs.
  constexpr int64_t kMaxBlocks = int64_t(1) << 30;
  Fp8Table t;
  t.count = 0;
  t.block_start[0] = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = grads[i].rows * grads[i].cols;
    if (n == 0) continue;
    const int64_t blocks = (n + kStateBlock - 1) / kStateBlock;
    if (t.count == kFp8MaxTensors ||
        (t.count > 0 && t.block_start[t.count] + blocks > kMaxBlocks)) {
      const cudaError_t err = Launch(t, one_minus_beta, beta, nesterov, stream);
      if (err != cudaSuccess) return err;
      t.count = 0;
    }
    if (blocks > kMaxBlocks) return cudaErrorInvalidValue;
    const int k = t.count++;
    t.grad[k] = grads[i];
    t.out[k] = outs[i];
    t.codes_in[k] = static_cast<const uint8_t*>(moms_in[i].data);
    t.codes_out[k] = static_cast<uint8_t*>(moms_out[i].data);
    t.scales_in[k] = scales_in[i];
    t.scales_out[k] = scales_out[i];
    t.block_start[k + 1] = t.block_start[k] + int(blocks);
  }
  return Launch(t, one_minus_beta, beta, nesterov, stream);
}

cudaError_t AdamWFp8(const KView& param, const KView& grad, void* exp_avg,
                     void* exp_avg_sq, float* exp_avg_scales,
                     float* exp_avg_sq_scales, float param_decay,
                     float one_minus_beta1, float beta2, float one_minus_beta2,
                     float step_size, float bc2_sqrt, float eps,
                     cudaStream_t stream) {
  const int64_t blocks =
      (param.rows * param.cols + kStateBlock - 1) / kStateBlock;
  if (blocks == 0) return cudaSuccess;
  if (blocks >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  const AdamWFp8Args args{param,
                          grad,
                          static_cast<uint8_t*>(exp_avg),
                          static_cast<uint8_t*>(exp_avg_sq),
                          exp_avg_scales,
                          exp_avg_sq_scales,
                          param_decay,
                          one_minus_beta1,
                          beta2,
                          one_minus_beta2,
                          step_size,
                          bc2_sqrt,
                          eps};
  AdamWFp8Kernel<<<unsigned(blocks), kStateBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace cuda_kernels
}  // namespace muond
