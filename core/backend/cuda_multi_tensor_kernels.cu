// Multi-tensor launches of the elementwise steps (MuonMomentumMulti,
// ApplyUpdateMulti, MarkNonFiniteMulti, AdaMuonNormalizeMulti): many contiguous
// tensors per launch, 4 elements per access where aligned; a tensor that does
// not fit a table runs alone through the single-tensor launchers
// (cuda_step_kernels.cu).
#include <cstdint>

#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"

namespace muond {
namespace cuda_kernels {
namespace {

// ---- multi-tensor launches ------------------------------------------------
// Up to kMultiMaxTensors contiguous tensors per launch, passed by value in the
// kernel arguments (< 4 KB). Block b works on tensor k with
// block_start[k] <= b < block_start[k + 1], elements
// [(b - block_start[k]) * kMultiTile, + kMultiTile).
constexpr int kMultiViews = 4;
constexpr int64_t kMultiTile = int64_t(kThreads) * kIlp * 4;
struct MultiTable {
  char* ptr[kMultiViews][kMultiMaxTensors];
  int64_t n[kMultiMaxTensors];
  int block_start[kMultiMaxTensors + 1];
  unsigned char elem[kMultiViews][kMultiMaxTensors];
  // 2-byte elements of view v of tensor k are fp16 (else bf16). Only an op's
  // kF16View may be fp16 in a table (RunMulti sends any other fp16 view
  // alone).
  bool f16[kMultiViews][kMultiMaxTensors];
  // Every view of tensor k is fp32 and 16-byte aligned or 2-byte (bf16,
  // fp16) and 8-byte aligned: the kernels move 4 elements per access (float4
  // / 4 x 2 bytes; the
  // scalar loop reached only 56-74% of HBM bandwidth on an H200,
  // bench/results/gpu_h200.md).
  bool vec4[kMultiMaxTensors];
  float scalar[kMultiMaxTensors];  // a per-tensor operand (the update's lr)
  // The update's row factors (null: none) and the tensor's columns, to find
  // an element's row.
  const float* rowf[kMultiMaxTensors];
  int64_t cols[kMultiMaxTensors];
  int count;
  // The dtypes of the table's vec4 tensors, one bit per view (1 = 2 bytes)
  // and, for an op with a kF16View, one more (bit kViews: that view is fp16),
  // the same for all of them (RunMulti starts a new table when it changes):
  // the
  // kernel is compiled for it, so the vec4 loads have no dtype branch between
  // them and stay in flight together (a branch per load cost the bf16 update
  // a quarter of its bandwidth). -1: no vec4 tensor yet.
  int vec4_sig;
};

// Bytes per element of view v under a vec4 signature.
__host__ __device__ constexpr int ElemOf(int sig, int v) {
  return (sig >> v) & 1 ? 2 : 4;
}
// Whether view v of op F is fp16 under a vec4 signature.
template <typename F>
__host__ __device__ constexpr bool F16Of(int sig, int v) {
  return F::kF16View == v && ((sig >> F::kViews) & 1);
}
// Signatures of op F: 2-byte bits per view, and the fp16 bit if it has a
// kF16View.
template <typename F>
__host__ __device__ constexpr int SignatureCount() {
  return 1 << (F::kViews + (F::kF16View >= 0 ? 1 : 0));
}

__device__ __forceinline__ float4 Ld4(const char* p, int elem, int64_t j) {
  return elem == 4 ? Ld4<4>(p, j) : Ld4<2>(p, j);
}

__device__ __forceinline__ float LdFlat(const char* p, int elem, int64_t j) {
  if (elem == 4) return reinterpret_cast<const float*>(p)[j];
  return Bf16BitsToFloat(reinterpret_cast<const uint16_t*>(p)[j]);
}
__device__ __forceinline__ void StFlat(char* p, int elem, int64_t j, float x) {
  if (elem == 4) {
    reinterpret_cast<float*>(p)[j] = x;
  } else {
    reinterpret_cast<uint16_t*>(p)[j] = FloatToBf16Bits(x);
  }
}
// Element j of view v of tensor k, in the view's dtype (fp16 included).
__device__ __forceinline__ float LdAt(const MultiTable& t, int v, int k,
                                      int64_t j) {
  if (!t.f16[v][k]) return LdFlat(t.ptr[v][k], t.elem[v][k], j);
  return LdElem<2, true>(t.ptr[v][k] + j * 2);
}
__device__ __forceinline__ void StAt(const MultiTable& t, int v, int k,
                                     int64_t j, float x) {
  if (!t.f16[v][k]) return StFlat(t.ptr[v][k], t.elem[v][k], j, x);
  StElem<2, true>(t.ptr[v][k] + j * 2, x);
}

__device__ __forceinline__ int MultiTensorOf(const MultiTable& t, int b) {
  return EntryOfBlock(t.block_start, t.count, b);
}

// A vec4 tensor's tile: each thread moves kIlp runs of 4 consecutive
// elements, the op's first F::kLoads (<= 2) views loaded as float4 before any
// store, dtypes fixed by kSig; a ragged end (n % 4) goes element by element
// through Load/Store.
template <typename F, int kSig>
__device__ void MultiVec4Tile(const MultiTable& t, const F& f, int k,
                              int64_t t0, int64_t end) {
  static_assert(F::kLoads == 2, "two loaded views");
  float4 in[kIlp][F::kLoads];
#pragma unroll
  for (int u = 0; u < kIlp; ++u) {
    const int64_t j = t0 + (int64_t(u) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end) {
      in[u][0] = Ld4<ElemOf(kSig, 0), F16Of<F>(kSig, 0)>(t.ptr[0][k], j);
      in[u][1] = Ld4<ElemOf(kSig, 1), F16Of<F>(kSig, 1)>(t.ptr[1][k], j);
    }
  }
#pragma unroll
  for (int u = 0; u < kIlp; ++u) {
    const int64_t j = t0 + (int64_t(u) * kThreads + threadIdx.x) * 4;
    if (j + 4 <= end) {
      f.template Store4<kSig>(t, k, j, in[u]);
    } else {
      for (int64_t e = j; e < end; ++e) f.Store(t, k, e, f.Load(t, k, e));
    }
  }
}

// Load-store op over the table: In Load(t, k, j), Store(t, k, j, In), and
// for vec4 tensors Store4<kSig>(t, k, j, float4[kLoads]) on 4 elements from
// j; kSig is the table's vec4_sig.
template <typename F, int kSig>
__global__ void MultiLoadStoreKernel(MultiTable t, F f) {
  const int k = MultiTensorOf(t, blockIdx.x);
  const int64_t n = t.n[k];
  const int64_t t0 = int64_t(blockIdx.x - t.block_start[k]) * kMultiTile;
  const int64_t end = t0 + kMultiTile < n ? t0 + kMultiTile : n;
  if (t.vec4[k]) {  // kMultiTile = kThreads * kIlp * 4: one pass per tile
    MultiVec4Tile<F, kSig>(t, f, k, t0, end);
    return;
  }
  for (int64_t base = t0 + threadIdx.x; base < end; base += kThreads * kIlp) {
    typename F::In in[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = base + u * kThreads;
      if (j < end) in[u] = f.Load(t, k, j);
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = base + u * kThreads;
      if (j < end) f.Store(t, k, j, in[u]);
    }
  }
}

__global__ void MultiFiniteKernel(MultiTable t, float limit, int* flag) {
  const int k = MultiTensorOf(t, blockIdx.x);
  const int64_t n = t.n[k];
  const int64_t t0 = int64_t(blockIdx.x - t.block_start[k]) * kMultiTile;
  const int64_t end = t0 + kMultiTile < n ? t0 + kMultiTile : n;
  bool bad = false;
  if (t.vec4[k]) {
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = t0 + (int64_t(u) * kThreads + threadIdx.x) * 4;
      if (j + 4 <= end) {
        const float4 x = Ld4(t.ptr[0][k], t.elem[0][k], j);
        bad = bad || OutOfRange(x.x, limit) || OutOfRange(x.y, limit) ||
              OutOfRange(x.z, limit) || OutOfRange(x.w, limit);
      } else {
        for (int64_t e = j; e < end; ++e)
          bad = bad || OutOfRange(LdFlat(t.ptr[0][k], t.elem[0][k], e), limit);
      }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
    return;
  }
  for (int64_t base = t0 + threadIdx.x; base < end; base += kThreads * kIlp) {
    float x[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = base + u * kThreads;
      x[u] = j < end ? LdFlat(t.ptr[0][k], t.elem[0][k], j) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) bad = bad || OutOfRange(x[u], limit);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;
}

// Views: 0 grad, 1 momentum in, 2 NS input, 3 momentum out (may be view 1).
// A null NS input or momentum out (Backend::MuonMomentum's Absent) is not
// written; its dtype still sets the signature.
struct MultiMomentumOp {
  static constexpr int kViews = 4;
  static constexpr int kF16View = -1;
  float w_ema, w_nesterov;
  bool nesterov;
  GradCheck check;
  struct In {
    float g, m;
  };
  __device__ In Load(const MultiTable& t, int k, int64_t j) const {
    return In{LdFlat(t.ptr[0][k], t.elem[0][k], j),
              LdFlat(t.ptr[1][k], t.elem[1][k], j)};
  }
  __device__ void Store(const MultiTable& t, int k, int64_t j, In in) const {
    MarkOutOfRange(check, in.g);
    const float m_new = ew::MomentumEma(in.m, in.g, w_ema);
    if (t.ptr[3][k] != nullptr) StFlat(t.ptr[3][k], t.elem[3][k], j, m_new);
    if (t.ptr[2][k] == nullptr) return;
    const float m =
        t.elem[1][k] == 4 ? m_new : Bf16BitsToFloat(FloatToBf16Bits(m_new));
    StFlat(t.ptr[2][k], t.elem[2][k], j,
           nesterov ? ew::NesterovInput(in.g, m, w_nesterov) : m);
  }
  static constexpr int kLoads = 2;  // grad, momentum in
  template <int kSig>
  __device__ void Store4(const MultiTable& t, int k, int64_t j,
                         float4 (&in)[kLoads]) const {
    constexpr bool bf16_state = ElemOf(kSig, 1) == 2;
    float4 m_new, out;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      MarkOutOfRange(check, At(in[0], e));
      At(m_new, e) = ew::MomentumEma(At(in[1], e), At(in[0], e), w_ema);
      // The stored value (bf16 state: rounded once), as in Store.
      const float m = bf16_state
                          ? Bf16BitsToFloat(FloatToBf16Bits(At(m_new, e)))
                          : At(m_new, e);
      At(out, e) =
          nesterov ? ew::NesterovInput(At(in[0], e), m, w_nesterov) : m;
    }
    if (t.ptr[3][k] != nullptr) St4<ElemOf(kSig, 3)>(t.ptr[3][k], j, m_new);
    if (t.ptr[2][k] != nullptr) St4<ElemOf(kSig, 2)>(t.ptr[2][k], j, out);
  }
};

struct MultiUpdateOp {              // lr: t.scalar[k]
  static constexpr int kViews = 2;  // param, update
  // The update may be fp16 (Gram NS's result, NsResultDType).
  static constexpr int kF16View = 1;
  float decay;
  int method;
  struct In {
    float p, u;
  };
  // The row of element j of tensor k: a 32-bit division (a table tensor has
  // fewer than 2^31 elements), a 64-bit one costs more than the memory.
  __device__ static int64_t RowOf(const MultiTable& t, int k, int64_t j) {
    return int64_t(uint32_t(j) / uint32_t(t.cols[k]));
  }
  // The update element j of tensor k, times its row's factor if it has one.
  __device__ static float Scaled(const MultiTable& t, int k, int64_t j,
                                 float u) {
    const float* f = t.rowf[k];
    return f == nullptr ? u : ew::Mul(u, f[RowOf(t, k, j)]);
  }
  __device__ In Load(const MultiTable& t, int k, int64_t j) const {
    return In{LdFlat(t.ptr[0][k], t.elem[0][k], j), LdAt(t, 1, k, j)};
  }
  __device__ void Store(const MultiTable& t, int k, int64_t j, In in) const {
    StFlat(t.ptr[0][k], t.elem[0][k], j,
           ew::UpdateParam(in.p, Scaled(t, k, j, in.u), t.scalar[k], decay,
                           method));
  }
  static constexpr int kLoads = 2;  // param, update
  template <int kSig>
  __device__ void Store4(const MultiTable& t, int k, int64_t j,
                         float4 (&in)[kLoads]) const {
    const float lr = t.scalar[k];
    float4 p;
    const float* f = t.rowf[k];
    // One division for the 4 elements: they are in row r or the next ones.
    int64_t r = f == nullptr ? 0 : RowOf(t, k, j);
    int64_t row_end = (r + 1) * t.cols[k];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float u = At(in[1], e);
      if (f != nullptr) {
        while (j + e >= row_end) {
          ++r;
          row_end += t.cols[k];
        }
        u = ew::Mul(u, f[r]);
      }
      At(p, e) = ew::UpdateParam(At(in[0], e), u, lr, decay, method);
    }
    St4<ElemOf(kSig, 0)>(t.ptr[0][k], j, p);
  }
};

// Views: 0 update (in place), 1 second moment in, 2 second moment out (may
// be view 1).
struct MultiAdaMuonOp {
  static constexpr int kViews = 3;
  // The update may be fp16 (Gram NS's result, NsResultDType).
  static constexpr int kF16View = 0;
  float one_minus_beta2, eps;
  struct In {
    float u, v;
  };
  __device__ In Load(const MultiTable& t, int k, int64_t j) const {
    return In{LdAt(t, 0, k, j), LdFlat(t.ptr[1][k], t.elem[1][k], j)};
  }
  __device__ void Store(const MultiTable& t, int k, int64_t j, In in) const {
    const ew::AdaMuonOut o =
        ew::AdaMuonElement(in.u, in.v, one_minus_beta2, eps);
    StFlat(t.ptr[2][k], t.elem[2][k], j, o.v);
    StAt(t, 0, k, j, o.u);
  }
  static constexpr int kLoads = 2;  // update, second moment in
  template <int kSig>
  __device__ void Store4(const MultiTable& t, int k, int64_t j,
                         float4 (&in)[kLoads]) const {
    float4 u, v;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const ew::AdaMuonOut o =
          ew::AdaMuonElement(At(in[0], e), At(in[1], e), one_minus_beta2, eps);
      At(u, e) = o.u;
      At(v, e) = o.v;
    }
    St4<ElemOf(kSig, 2)>(t.ptr[2][k], j, v);
    St4<ElemOf(kSig, 0), F16Of<MultiAdaMuonOp>(kSig, 0)>(t.ptr[0][k], j, u);
  }
};

bool Vec4Ok(const KView& v) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(v.data);
  return (v.elem == 4 && a % 16 == 0) || (v.elem == 2 && a % 8 == 0);
}

// Collects tensors into tables and launches `launch(table)` per full table;
// `single(i)` launches tensor i alone (non-contiguous, large, or fp16 in a
// view other than `f16_view`, -1: none). `scalars` (may be null) gives each
// tensor's MultiTable::scalar, `row_factors` (may be null) its
// MultiTable::rowf.
template <typename Launch, typename Single>
cudaError_t RunMulti(const KView* const* views, int nviews, int f16_view,
                     int64_t count, const float* scalars,
                     const float* const* row_factors, Launch launch,
                     Single single) {
  MultiTable t;
  t.count = 0;
  t.block_start[0] = 0;
  t.vec4_sig = -1;
  auto flush = [&]() -> cudaError_t {
    if (t.count == 0) return cudaSuccess;
    const cudaError_t err = launch(t);
    t.count = 0;
    t.vec4_sig = -1;
    return err;
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = views[0][i].rows * views[0][i].cols;
    if (n == 0) continue;
    bool flat = n < kMultiMaxElems;
    // The tables' loads know fp32, bf16 and fp16 in f16_view; any other
    // fp16 goes alone.
    for (int v = 0; v < nviews && flat; ++v)
      flat = Flat({views[v][i]}) && (!views[v][i].f16 || v == f16_view);
    if (!flat) {
      const cudaError_t err = single(i);
      if (err != cudaSuccess) return err;
      continue;
    }
    bool vec4 = true;
    int sig = 0;
    for (int v = 0; v < nviews; ++v) {
      vec4 = vec4 && Vec4Ok(views[v][i]);
      if (views[v][i].elem == 2) sig |= 1 << v;
    }
    if (f16_view >= 0 && views[f16_view][i].f16) sig |= 1 << nviews;
    if (vec4 && t.vec4_sig >= 0 && sig != t.vec4_sig) {
      const cudaError_t err = flush();  // one vec4 signature per table
      if (err != cudaSuccess) return err;
    }
    const int k = t.count;
    t.vec4[k] = vec4;
    if (vec4) t.vec4_sig = sig;
    for (int v = 0; v < nviews; ++v) {
      t.ptr[v][k] = static_cast<char*>(views[v][i].data);
      t.elem[v][k] = static_cast<unsigned char>(views[v][i].elem);
      t.f16[v][k] = views[v][i].f16;
    }
    t.scalar[k] = scalars == nullptr ? 0.0f : scalars[i];
    t.rowf[k] = row_factors == nullptr ? nullptr : row_factors[i];
    t.cols[k] = views[0][i].cols;
    t.n[k] = n;
    t.block_start[k + 1] =
        t.block_start[k] + int((n + kMultiTile - 1) / kMultiTile);
    ++t.count;
    if (t.count == kMultiMaxTensors) {
      const cudaError_t err = flush();
      if (err != cudaSuccess) return err;
    }
  }
  return flush();
}

}  // namespace

// Launches MultiLoadStoreKernel for a table, compiled for its vec4 dtypes:
// one instantiation per signature of op F (kSig from 0 up).
template <typename F, int kSig = 0>
cudaError_t LaunchTable(const MultiTable& t, const F& op, cudaStream_t stream) {
  if constexpr (kSig < SignatureCount<F>()) {
    if ((t.vec4_sig < 0 ? 0 : t.vec4_sig) != kSig) {
      return LaunchTable<F, kSig + 1>(t, op, stream);
    }
    const unsigned blocks = unsigned(t.block_start[t.count]);
    MultiLoadStoreKernel<F, kSig><<<blocks, kThreads, 0, stream>>>(t, op);
    return cudaGetLastError();
  } else {
    return cudaErrorInvalidValue;
  }
}

cudaError_t MuonMomentumMulti(const KView* grads, const KView* moms_in,
                              const KView* moms_out, const KView* outs,
                              int64_t count, float one_minus_beta, float beta,
                              bool nesterov, cudaStream_t stream,
                              GradCheck check) {
  const KView* views[MultiMomentumOp::kViews] = {grads, moms_in, outs,
                                                 moms_out};
  const MultiMomentumOp op{one_minus_beta, beta, nesterov, check};
  return RunMulti(
      views, MultiMomentumOp::kViews, MultiMomentumOp::kF16View, count, nullptr,
      nullptr, [&](const MultiTable& t) { return LaunchTable(t, op, stream); },
      [&](int64_t i) {
        return MuonMomentum(grads[i], moms_in[i], moms_out[i], one_minus_beta,
                            beta, nesterov, outs[i], stream, check);
      });
}

cudaError_t ApplyUpdateMulti(const KView* params, const KView* updates,
                             const float* lrs, int64_t count, float decay,
                             int method, cudaStream_t stream) {
  const KView* views[2] = {params, updates};
  const MultiUpdateOp op{decay, method};
  return RunMulti(
      views, MultiUpdateOp::kViews, MultiUpdateOp::kF16View, count, lrs,
      nullptr, [&](const MultiTable& t) { return LaunchTable(t, op, stream); },
      [&](int64_t i) {
        return ApplyUpdate(params[i], updates[i], lrs[i], decay, method,
                           stream);
      });
}

cudaError_t ApplyRowScaledUpdateMulti(const KView* params, const KView* updates,
                                      const float* const* factors,
                                      const float* lrs, int64_t count,
                                      float decay, int method,
                                      cudaStream_t stream) {
  const KView* views[2] = {params, updates};
  const MultiUpdateOp op{decay, method};
  return RunMulti(
      views, MultiUpdateOp::kViews, MultiUpdateOp::kF16View, count, lrs,
      factors, [&](const MultiTable& t) { return LaunchTable(t, op, stream); },
      [&](int64_t i) {
        return ApplyRowScaledUpdate(params[i], updates[i], factors[i], lrs[i],
                                    decay, method, stream);
      });
}

cudaError_t MarkNonFiniteMulti(const KView* views, int64_t count, float limit,
                               int* flag, cudaStream_t stream) {
  const KView* table[1] = {views};
  return RunMulti(
      table, 1, /*f16_view=*/-1, count, nullptr, nullptr,
      [&](const MultiTable& t) {
        MultiFiniteKernel<<<unsigned(t.block_start[t.count]), kThreads, 0,
                            stream>>>(t, limit, flag);
        return cudaGetLastError();
      },
      [&](int64_t i) { return MarkNonFinite(views[i], limit, flag, stream); });
}

cudaError_t AdaMuonNormalizeMulti(const KView* updates, const KView* v_in,
                                  const KView* v_out, int64_t count,
                                  float one_minus_beta2, float eps,
                                  cudaStream_t stream) {
  const KView* views[MultiAdaMuonOp::kViews] = {updates, v_in, v_out};
  const MultiAdaMuonOp op{one_minus_beta2, eps};
  return RunMulti(
      views, MultiAdaMuonOp::kViews, MultiAdaMuonOp::kF16View, count, nullptr,
      nullptr, [&](const MultiTable& t) { return LaunchTable(t, op, stream); },
      [&](int64_t i) {
        return AdaMuonNormalize(updates[i], v_in[i], v_out[i], one_minus_beta2,
                                eps, stream);
      });
}

}  // namespace cuda_kernels
}  // namespace muond
