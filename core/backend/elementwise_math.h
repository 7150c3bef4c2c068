#pragma once
// The elementwise formulas of the Muon and AdamW steps, written once for the
// CPU backend and the CUDA kernels (plain header: compiles under nvcc and
// g++). Every multiply/add is an explicitly rounded fp32 operation (device:
// __fmul_rn/__fadd_rn, which nvcc never contracts into FMAs; host: plain
// operators, which g++ in ISO C++ mode does not contract), so both backends
// produce bit-identical results.
#include <cmath>
#include <cstdint>

#include "core/backend/bf16.h"

namespace muond {
namespace ew {

#if defined(__CUDA_ARCH__)
MUOND_HD float Mul(float a, float b) { return __fmul_rn(a, b); }
MUOND_HD float Add(float a, float b) { return __fadd_rn(a, b); }
MUOND_HD float Sub(float a, float b) { return __fsub_rn(a, b); }
MUOND_HD float Div(float a, float b) { return __fdiv_rn(a, b); }
MUOND_HD float Sqrt(float a) { return __fsqrt_rn(a); }
#else
MUOND_HD float Mul(float a, float b) { return a * b; }
MUOND_HD float Add(float a, float b) { return a + b; }
MUOND_HD float Sub(float a, float b) { return a - b; }
MUOND_HD float Div(float a, float b) { return a / b; }
MUOND_HD float Sqrt(float a) { return std::sqrt(a); }
#endif

// torch.lerp(start, end, weight) as ATen evaluates it (Lerp.h):
// |w| < 0.5 ? start + w*(end - start) : end - (end - start)*(1 - w).
MUOND_HD float Lerp(float start, float end, float w) {
  const float diff = Sub(end, start);
  return (std::fabs(w) < 0.5f) ? Add(start, Mul(w, diff))
                               : Sub(end, Mul(diff, Sub(1.0f, w)));
}

// Muon momentum. one_minus_beta is float(1 - beta) computed in double on
// the host, as Python computes `1 - momentum` for torch's lerp_.
MUOND_HD float MomentumEma(float m, float g, float one_minus_beta) {
  return Lerp(m, g, one_minus_beta);
}
MUOND_HD float NesterovInput(float g, float m_new, float beta) {
  return Lerp(g, m_new, beta);
}

// method: 0 decoupled, 1 independent, 2 cautious, 3 none (WeightDecayMethod).
MUOND_HD float UpdateParam(float p, float u, float lr, float decay,
                           int method) {
  const bool do_decay =
      method == 0 || method == 1 || (method == 2 && Mul(u, p) > 0.0f);
  if (do_decay) p = Sub(p, Mul(decay, p));
  return Sub(p, Mul(lr, u));
}

struct AdamWOut {
  float p, m, v;
};
MUOND_HD AdamWOut AdamWElement(float p, float g, float m, float v,
                               float param_decay, float one_minus_beta1,
                               float beta2, float one_minus_beta2,
                               float step_size, float bc2_sqrt, float eps) {
  p = Mul(p, param_decay);
  m = Lerp(m, g, one_minus_beta1);
  v = Add(Mul(v, beta2), Mul(Mul(one_minus_beta2, g), g));
  const float denom = Add(Div(Sqrt(v), bc2_sqrt), eps);
  p = Add(p, Mul(-step_size, Div(m, denom)));
  return {p, m, v};
}

// AdaMuon (Emerging-Optimizers adaptive_muon.py, moment2_method "adamuon")
// on one element of the unscaled Newton–Schulz output u: v <- lerp(v, u*u,
// 1 - beta2); u <- u / (sqrt(v) + eps). one_minus_beta2 is float(1 - beta2)
// formed in double on the host.
struct AdaMuonOut {
  float u, v;
};
MUOND_HD AdaMuonOut AdaMuonElement(float u, float v, float one_minus_beta2,
                                   float eps) {
  v = Lerp(v, Mul(u, u), one_minus_beta2);
  return {Div(u, Add(Sqrt(v), eps)), v};
}

// NorMuon (core/muon/muon_variant.h) on row i of a full matrix of `cols`
// columns, from the row's sum of squares: the new state
// lerp(v, float(sumsq / cols), 1 - beta2), the mean formed in double and
// rounded once, as torch's mean of fp32 squares in the anchors...
MUOND_HD float NorMuonRowState(float v, float row_sumsq, int64_t cols,
                               float one_minus_beta2) {
  const float mean = static_cast<float>(double(row_sumsq) / double(cols));
  return Lerp(v, mean, one_minus_beta2);
}
// ... and the row's divisor sqrt(v_new) + eps in double. Row i's factor is
// sqrt(N1) / max(sqrt(N2), eps) / d_i with N1 = sum_i row_sumsq[i] and
// N2 = sum_i row_sumsq[i] / d_i^2 (NorMuonRowFactor).
MUOND_HD double NorMuonDenom(float v_new, double eps) {
  return std::sqrt(double(v_new)) + eps;
}
MUOND_HD double NorMuonN2Term(float row_sumsq, double denom) {
  return double(row_sumsq) / (denom * denom);
}
MUOND_HD double NorMuonRatio(double n1, double n2, double eps) {
  const double norm2 = std::sqrt(n2);
  return std::sqrt(n1) / (norm2 < eps ? eps : norm2);  // std::max's choice
}
MUOND_HD float NorMuonRowFactor(double ratio, double denom) {
  return static_cast<float>(ratio / denom);
}

}  // namespace ew
}  // namespace muond
