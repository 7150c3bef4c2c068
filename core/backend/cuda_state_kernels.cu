// Muon momentum on fp8 e4m3 state (MuonMomentumFp8Multi): one CTA per state
// block of kStateBlock consecutive elements, so the block's absmax is a
// reduction inside the CTA; many tensors per launch. The per-element math and
// the codec are elementwise_math.h's, as on the CPU backend, so both give the
// same bits.
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

}  // namespace cuda_kernels
}  // namespace muond
