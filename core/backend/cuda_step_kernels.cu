// The elementwise optimizer steps on one tensor: Muon's momentum (and
// Nesterov input), the update with weight decay, AdamW, and the finiteness
// check of a step's inputs and outputs. Elementwise math comes from
// elementwise_math.h (no FMA contraction: bit-identical to the CPU backend).
#include <type_traits>

#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"

namespace muond {
namespace cuda_kernels {
namespace {

// mom_out may be mom_in (in place): every element is loaded before it is
// stored, by the same thread. A null mom_out or out (Backend::MuonMomentum's
// Absent) is not written.
struct MomentumOp {
  DView grad, mom_in, mom_out, out;
  float w_ema, w_nesterov;
  bool nesterov;
  GradCheck check;
  struct In {
    float g, m;
  };
  __device__ In Load(int64_t j) const {
    return In{Ld(grad, 0, j), Ld(mom_in, 0, j)};
  }
  __device__ void Store(int64_t j, In in) const { Write(0, j, in.g, in.m); }
  __device__ void operator()(int64_t i, int64_t j) const {
    Write(i, j, Ld(grad, i, j), Ld(mom_in, i, j));
  }
  __device__ void Write(int64_t i, int64_t j, float g, float m_in) const {
    MarkOutOfRange(check, g);
    const float m_new = ew::MomentumEma(m_in, g, w_ema);
    if (mom_out.data != nullptr) St(mom_out, i, j, m_new);
    if (out.data == nullptr) return;
    // The stored value, without reading it back (bf16 state: rounded once).
    const float m =
        mom_in.elem == 4 ? m_new : Bf16BitsToFloat(FloatToBf16Bits(m_new));
    St(out, i, j, nesterov ? ew::NesterovInput(g, m, w_nesterov) : m);
  }
};

struct UpdateOp {
  DView p, u;
  float lr, decay;
  int method;
  struct In {
    float p, u;
  };
  __device__ In Load(int64_t j) const { return In{Ld(p, 0, j), Ld(u, 0, j)}; }
  __device__ void Store(int64_t j, In in) const {
    St(p, 0, j, ew::UpdateParam(in.p, in.u, lr, decay, method));
  }
  __device__ void operator()(int64_t i, int64_t j) const {
    St(p, i, j, ew::UpdateParam(Ld(p, i, j), Ld(u, i, j), lr, decay, method));
  }
};

struct RowScaledUpdateOp {
  DView p, u;
  const float* factors;
  float lr, decay;
  int method;
  __device__ void operator()(int64_t i, int64_t j) const {
    const float scaled = ew::Mul(Ld(u, i, j), factors[i]);
    St(p, i, j, ew::UpdateParam(Ld(p, i, j), scaled, lr, decay, method));
  }
};

// A load-store op (LaunchLoadStore): four streams read and three written per
// element, so the flat kernel's loads of several elements in flight matter
// most here.
struct AdamWOp {
  DView p, g, m, v;
  float param_decay, omb1, beta2, omb2, step_size, bc2, eps;
  struct In {
    float p, g, m, v;
  };
  __device__ In Load(int64_t j) const {
    return In{Ld(p, 0, j), Ld(g, 0, j), Ld(m, 0, j), Ld(v, 0, j)};
  }
  __device__ void Store(int64_t j, In in) const { Write(0, j, in); }
  __device__ void operator()(int64_t i, int64_t j) const {
    Write(i, j, In{Ld(p, i, j), Ld(g, i, j), Ld(m, i, j), Ld(v, i, j)});
  }
  // One element's AdamW: the arithmetic of every path (AdamWVec4Kernel's
  // too), so they agree bitwise.
  __device__ ew::AdamWOut Apply(In in) const {
    return ew::AdamWElement(in.p, in.g, in.m, in.v, param_decay, omb1, beta2,
                            omb2, step_size, bc2, eps);
  }
  __device__ void Write(int64_t i, int64_t j, In in) const {
    const ew::AdamWOut o = Apply(in);
    St(p, i, j, o.p);
    St(m, i, j, o.m);
    St(v, i, j, o.v);
  }
};

// AdamWOp on contiguous views 4 elements per access (float4 for fp32,
// 4 x 2 bytes for bf16; kP, kG, kS: the param's, grad's and moments' element
// bytes), kIlp runs per thread with every load issued before any store. The
// flat kernel's scalar loads moved the ~1B Llama's embeddings at ~76% of HBM
// bandwidth (bench/results/gpu_h100_adamw_vec4.md). The per-element math is
// AdamWOp's, so the results are bitwise its; the last n % 4 elements go
// through AdamWOp's own Load and Store.
template <int kP, int kG, int kS>
__global__ void AdamWVec4Kernel(AdamWOp f, int64_t n) {
  const int64_t quads = n / 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t base = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
       base < quads; base += stride * kIlp) {
    float4 p[kIlp], g[kIlp], m[kIlp], v[kIlp];
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = (base + u * stride) * 4;
      if (j < 4 * quads) {
        p[u] = Ld4<kP>(f.p.data, j);
        g[u] = Ld4<kG>(f.g.data, j);
        m[u] = Ld4<kS>(f.m.data, j);
        v[u] = Ld4<kS>(f.v.data, j);
      }
    }
#pragma unroll
    for (int u = 0; u < kIlp; ++u) {
      const int64_t j = (base + u * stride) * 4;
      if (j >= 4 * quads) continue;
      float4 po, mo, vo;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const ew::AdamWOut o = f.Apply(
            AdamWOp::In{At(p[u], e), At(g[u], e), At(m[u], e), At(v[u], e)});
        At(po, e) = o.p;
        At(mo, e) = o.m;
        At(vo, e) = o.v;
      }
      St4<kP>(f.p.data, j, po);
      St4<kS>(f.m.data, j, mo);
      St4<kS>(f.v.data, j, vo);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < n - 4 * quads) {
    const int64_t j = 4 * quads + threadIdx.x;
    f.Store(j, f.Load(j));
  }
}

// AdamWVec4Kernel applies: every view contiguous, fp32 or bf16 (not fp16),
// the moments of one dtype, each base aligned for its 4-element accesses.
bool AdamWVec4Ok(const KView& p, const KView& g, const KView& m,
                 const KView& v) {
  if (!Flat({p, g, m, v}) || m.elem != v.elem) return false;
  for (const KView& x : {p, g, m, v}) {
    if ((x.elem != 4 && x.elem != 2) || x.f16) return false;
    if (reinterpret_cast<uintptr_t>(x.data) % (4 * x.elem) != 0) return false;
  }
  return true;
}

// f(std::integral_constant<int, 4 or 2>): an element size as a constant.
template <typename F>
cudaError_t WithElemSize(int elem, F f) {
  return elem == 4 ? f(std::integral_constant<int, 4>{})
                   : f(std::integral_constant<int, 2>{});
}

template <int kP, int kG, int kS>
cudaError_t LaunchAdamWVec4(const AdamWOp& f, int64_t n, cudaStream_t stream) {
  int64_t blocks = (n / 4 + int64_t(kThreads) * kIlp - 1) / (kThreads * kIlp);
  if (blocks > kMaxFlatBlocks) blocks = kMaxFlatBlocks;
  if (blocks < 1) blocks = 1;
  AdamWVec4Kernel<kP, kG, kS><<<unsigned(blocks), kThreads, 0, stream>>>(f, n);
  return cudaGetLastError();
}

struct FiniteOp {
  DView v;
  float limit;
  int* flag;
  __device__ void operator()(int64_t i, int64_t j) const {
    if (OutOfRange(Ld(v, i, j), limit)) *flag = 1;
  }
};

}  // namespace

cudaError_t MuonMomentum(const KView& grad, const KView& momentum_in,
                         const KView& momentum_out, float one_minus_beta,
                         float beta, bool nesterov, const KView& out,
                         cudaStream_t stream, GradCheck check) {
  return LaunchLoadStore(
      {grad, momentum_in, momentum_out, out}, grad.rows, grad.cols, stream,
      MomentumOp{D(grad), D(momentum_in), D(momentum_out), D(out),
                 one_minus_beta, beta, nesterov, check});
}

cudaError_t ApplyUpdate(const KView& param, const KView& update, float lr,
                        float decay, int method, cudaStream_t stream) {
  return LaunchLoadStore({param, update}, param.rows, param.cols, stream,
                         UpdateOp{D(param), D(update), lr, decay, method});
}

cudaError_t ApplyRowScaledUpdate(const KView& param, const KView& update,
                                 const float* factors, float lr, float decay,
                                 int method, cudaStream_t stream) {
  return LaunchForEach(
      {param, update}, param.rows, param.cols, stream,
      RowScaledUpdateOp{D(param), D(update), factors, lr, decay, method});
}

cudaError_t AdamW(const KView& param, const KView& grad, const KView& exp_avg,
                  const KView& exp_avg_sq, float param_decay,
                  float one_minus_beta1, float beta2, float one_minus_beta2,
                  float step_size, float bc2_sqrt, float eps,
                  cudaStream_t stream) {
  const AdamWOp f{D(param),    D(grad),         D(exp_avg), D(exp_avg_sq),
                  param_decay, one_minus_beta1, beta2,      one_minus_beta2,
                  step_size,   bc2_sqrt,        eps};
  const int64_t n = param.rows * param.cols;
  if (n > 0 && AdamWVec4Ok(param, grad, exp_avg, exp_avg_sq)) {
    // Every combination of fp32 and bf16: 8 instantiations.
    return WithElemSize(param.elem, [&](auto kp) {
      return WithElemSize(grad.elem, [&](auto kg) {
        return WithElemSize(exp_avg.elem, [&](auto ks) {
          return LaunchAdamWVec4<decltype(kp)::value, decltype(kg)::value,
                                 decltype(ks)::value>(f, n, stream);
        });
      });
    });
  }
  return LaunchLoadStore({param, grad, exp_avg, exp_avg_sq}, param.rows,
                         param.cols, stream, f);
}

cudaError_t MarkNonFinite(const KView& v, float limit, int* flag,
                          cudaStream_t stream) {
  return LaunchForEach({v}, v.rows, v.cols, stream,
                       FiniteOp{D(v), limit, flag});
}

}  // namespace cuda_kernels
}  // namespace muond
