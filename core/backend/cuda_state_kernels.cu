// Optimizer steps on fp8 e4m3 state: Muon momentum (MuonMomentumFp8Multi,
// many tensors per launch) and AdamW (AdamWFp8). Each state block of
// kStateBlock consecutive elements is one warp's (momentum) or one CTA's
// (AdamW), so a block's absmax is a reduction inside it. The per-element math
// and the codec are elementwise_math.h's, as on the CPU backend, so both give
// the same bits.
#include <cstdint>

#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"
#include "core/common/state_storage.h"

namespace muond {
namespace cuda_kernels {
namespace {

static_assert(kStateBlock == kThreads, "AdamW: one thread per element");

// Up to kFp8MaxTensors tensors per launch, by value in the kernel arguments
// (< 4 KB). Warp w works on tensor k with block_start[k] <= w <
// block_start[k + 1], state block w - block_start[k] of it.
constexpr int kFp8MaxTensors = 24;
struct Fp8Table {
  KView grad[kFp8MaxTensors], out[kFp8MaxTensors];
  const uint8_t* codes_in[kFp8MaxTensors];
  uint8_t* codes_out[kFp8MaxTensors];
  const float* scales_in[kFp8MaxTensors];
  float* scales_out[kFp8MaxTensors];
  bool vector[kFp8MaxTensors];  // VectorFriendly grad, out and codes
  int block_start[kFp8MaxTensors + 1];
  int count;
};

__device__ DView DeviceView(const KView& v) {
  return DView{static_cast<char*>(v.data), v.rows, v.cols, v.ld, v.elem, v.f16};
}

// The warp's ew::AbsMaxStep fold: max of |v|, NaN if any is NaN (order-
// independent, so the tree gives the sequential fold's value).
__device__ float WarpAbsMax(float v) {
  float a = ew::AbsMaxStep(0.0f, v);
  for (int offset = 16; offset > 0; offset /= 2) {
    a = ew::AbsMaxStep(a, __shfl_xor_sync(0xffffffffu, a, offset));
  }
  return a;
}

// The same fold over the CTA: each warp's, then theirs.
__device__ float BlockAbsMax(float v) {
  __shared__ float warp_max[kStateBlock / 32];
  float a = WarpAbsMax(v);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = a;
  __syncthreads();
  a = 0.0f;
  for (int w = 0; w < kStateBlock / 32; ++w) a = ew::AbsMaxStep(a, warp_max[w]);
  __syncthreads();  // warp_max is free for the next reduction
  return a;
}

// Muon momentum: one warp per state block, 8 elements per lane, so a
// block's absmax is a warp shuffle (no CTA barrier) and there is no integer
// division per element on the contiguous path. Lane l holds elements
// r * 128 + 4 * l + q (r < 2, q < 4) of its block: each of its loads is 4
// consecutive elements, one vector load, and a warp's loads are coalesced.
constexpr int kWarpsPerCta = kThreads / 32;
constexpr int kPerLane = kStateBlock / 32;
static_assert(kPerLane == 8, "two runs of 4 consecutive elements per lane");

__device__ __forceinline__ int64_t LaneElement(int r, int q) {
  return r * 128 + 4 * (threadIdx.x % 32) + q;
}

// Four consecutive elements at flat offset e of a contiguous view whose data
// is aligned to 4 elements (the contiguous path's precondition).
__device__ __forceinline__ void Load4(const DView& v, int64_t e, float* x) {
  if (v.elem == 4) {
    const float4 f = *reinterpret_cast<const float4*>(v.data + e * 4);
    x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    return;
  }
  const uint2 u = *reinterpret_cast<const uint2*>(v.data + e * 2);
  const uint16_t h[4] = {uint16_t(u.x), uint16_t(u.x >> 16), uint16_t(u.y),
                         uint16_t(u.y >> 16)};
  for (int q = 0; q < 4; ++q)
    x[q] = v.f16 ? F16BitsToFloat(h[q]) : Bf16BitsToFloat(h[q]);
}

__device__ __forceinline__ void Store4(const DView& v, int64_t e,
                                       const float* x) {
  if (v.elem == 4) {
    *reinterpret_cast<float4*>(v.data + e * 4) =
        make_float4(x[0], x[1], x[2], x[3]);
    return;
  }
  uint16_t h[4];
  for (int q = 0; q < 4; ++q)
    h[q] = v.f16 ? FloatToF16Bits(x[q]) : FloatToBf16Bits(x[q]);
  *reinterpret_cast<uint2*>(v.data + e * 2) =
      make_uint2(h[0] | (uint32_t(h[1]) << 16), h[2] | (uint32_t(h[3]) << 16));
}

// A tensor takes the vector path when grad, out and the codes are contiguous
// and aligned for Load4/Store4 and 4-byte code words; its last block too if
// that block is full.
bool VectorFriendly(const KView& v) {
  const auto address = reinterpret_cast<uintptr_t>(v.data);
  return (v.rows <= 1 || v.ld == v.cols) && address % (4 * v.elem) == 0;
}

__global__ void MomentumFp8Kernel(Fp8Table t, float w_ema, float w_nesterov,
                                  bool nesterov, GradCheck check) {
  const int warp = int(blockIdx.x) * kWarpsPerCta + int(threadIdx.x / 32);
  if (warp >= t.block_start[t.count]) return;  // whole warps leave together
  const int k = EntryOfBlock(t.block_start, t.count, warp);
  const DView grad = DeviceView(t.grad[k]), out = DeviceView(t.out[k]);
  const int64_t b = int64_t(warp) - t.block_start[k];
  const int64_t first = b * kStateBlock, n = grad.rows * grad.cols;
  const bool vector = t.vector[k] && first + kStateBlock <= n;
  const uint8_t* codes_in = t.codes_in[k] + first;
  const float scale_in = t.scales_in[k][b];
  // Every read (codes and scale in) happens before WarpAbsMax's shuffles,
  // every write after them: in place is safe.
  float m_new[kPerLane];
  uint32_t code_words[2];
  for (int r = 0; r < 2; ++r) {
    const int64_t e0 = LaneElement(r, 0);
    float g[4];
    if (vector) {
      Load4(grad, first + e0, g);
      code_words[r] = *reinterpret_cast<const uint32_t*>(codes_in + e0);
    }
    for (int q = 0; q < 4; ++q) {
      float& m = m_new[4 * r + q];
      const int64_t e = first + e0 + q;
      if (!vector) {
        if (e >= n) {
          m = 0.0f;
          continue;
        }
        g[q] = Ld(grad, e / grad.cols, e % grad.cols);
      }
      MarkOutOfRange(check, g[q]);
      const uint8_t code =
          vector ? uint8_t(code_words[r] >> (8 * q)) : codes_in[e0 + q];
      m = ew::MomentumEma(ew::DequantizeE4M3(code, scale_in), g[q], w_ema);
      g[q] = nesterov ? ew::NesterovInput(g[q], m, w_nesterov) : m;
      if (!vector && out.data != nullptr)
        St(out, e / out.cols, e % out.cols, g[q]);
    }
    if (vector && out.data != nullptr) Store4(out, first + e0, g);
  }
  if (t.codes_out[k] == nullptr) return;  // momentum out absent
  float absmax = 0.0f;
  for (int i = 0; i < kPerLane; ++i) absmax = ew::AbsMaxStep(absmax, m_new[i]);
  const float scale = ew::BlockScale(WarpAbsMax(absmax));
  uint8_t* codes_out = t.codes_out[k] + first;
  for (int r = 0; r < 2; ++r) {
    const int64_t e0 = LaneElement(r, 0);
    uint32_t word = 0;
    for (int q = 0; q < 4; ++q) {
      const uint8_t code = ew::QuantizeE4M3(m_new[4 * r + q], scale);
      if (vector) {
        word |= uint32_t(code) << (8 * q);
      } else if (first + e0 + q < n) {
        codes_out[e0 + q] = code;
      }
    }
    if (vector) *reinterpret_cast<uint32_t*>(codes_out + e0) = word;
  }
  if (threadIdx.x % 32 == 0) t.scales_out[k][b] = scale;
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
                   bool nesterov, GradCheck check, cudaStream_t stream) {
  if (t.count == 0) return cudaSuccess;
  const int warps = t.block_start[t.count];
  MomentumFp8Kernel<<<unsigned((warps + kWarpsPerCta - 1) / kWarpsPerCta),
                      kThreads, 0, stream>>>(t, w_ema, w_nesterov, nesterov,
                                             check);
  return cudaGetLastError();
}

}  // namespace

cudaError_t MuonMomentumFp8Multi(const KView* grads, const KView* moms_in,
                                 const KView* moms_out, const KView* outs,
                                 const float* const* scales_in,
                                 float* const* scales_out, int64_t count,
                                 float one_minus_beta, float beta,
                                 bool nesterov, cudaStream_t stream,
                                 GradCheck check) {
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
      const cudaError_t err =
          Launch(t, one_minus_beta, beta, nesterov, check, stream);
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
    t.vector[k] = VectorFriendly(grads[i]) && VectorFriendly(outs[i]) &&
                  VectorFriendly(moms_in[i]) && VectorFriendly(moms_out[i]);
    t.block_start[k + 1] = t.block_start[k] + int(blocks);
  }
  return Launch(t, one_minus_beta, beta, nesterov, check, stream);
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
