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
#include "core/common/state_storage.h"

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

// ---- fp8 e4m3 state (core/common/state_storage.h) --------------------------
// OCP e4m3fn, the format of CUDA's __nv_fp8_e4m3: sign, 4 exponent bits (bias
// 7), 3 mantissa bits, no infinities; S.1111.111 is NaN, so the largest
// finite magnitude is 1.75 * 2^8 = 448 (0x7e); subnormals are m * 2^-9.
// Integer code only, so both backends give the same bits.
inline constexpr float kE4M3Max = 448.0f;
inline constexpr uint8_t kE4M3NaN = 0x7f;

// fp32 -> e4m3, round to nearest even, saturating: |x| >= 448 (infinities
// included) gives +-448; NaN gives kE4M3NaN; the sign of a zero is kept.
MUOND_HD uint8_t FloatToE4M3(float x) {
  const uint32_t bits = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return kE4M3NaN;
  if (mag >= 0x43e00000u) return sign | 0x7eu;  // 448 and beyond
  if (mag >= 0x3c800000u) {  // >= 2^-6: normal, keep 3 of 23 mantissa bits
    const uint32_t rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);
    return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));
  }
  // Subnormal (or zero): round mag / 2^-9 to an integer; 8 is 2^-6's code.
  const int exponent = int(mag >> 23) - 127;
  const int shift = 14 - exponent;  // mantissa (with its leading 1) >> shift
  if ((mag >> 23) == 0 || shift > 24) return sign;
  const uint32_t mantissa = (mag & 0x7fffffu) | 0x800000u;
  const uint32_t q = mantissa >> shift;
  const uint32_t rem = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t up = rem > half || (rem == half && (q & 1u)) ? 1u : 0u;
  return sign | static_cast<uint8_t>(q + up);
}

// e4m3 -> fp32, exact.
MUOND_HD float E4M3ToFloat(uint8_t code) {
  const uint32_t sign = uint32_t(code & 0x80u) << 24;
  if ((code & 0x7fu) == 0x7fu) return BitsToFloat(sign | 0x7fc00000u);
  const uint32_t exponent = (code >> 3) & 0xfu, mantissa = code & 7u;
  if (exponent == 0) {  // m * 2^-9, exact in fp32
    const float m = static_cast<float>(mantissa) * 0.001953125f;
    return sign != 0 ? -m : m;
  }
  return BitsToFloat(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// Blockwise scaling: a block is kStateBlock consecutive elements of a shard's
// contiguous state (the last may be short), stored as e4m3 codes of
// v / scale with scale = absmax / 448 in fp32; an all-zero block (or one whose
// scale underflows to 0) has scale 0 and codes 0. value = float(code) * scale.
// The block's absmax folds AbsMaxStep over its elements from 0: the max of
// |v|, or NaN if any element is NaN, whatever the order (so a tree reduction
// on the device gives the sequential fold's value).
MUOND_HD float AbsMaxStep(float absmax, float v) {
  const float a = std::fabs(v);
  return (a != a || a > absmax) ? a : absmax;
}
MUOND_HD float BlockScale(float absmax) { return Div(absmax, kE4M3Max); }
MUOND_HD uint8_t QuantizeE4M3(float v, float scale) {
  return scale == 0.0f ? uint8_t(0) : FloatToE4M3(Div(v, scale));
}
MUOND_HD float DequantizeE4M3(uint8_t code, float scale) {
  return Mul(E4M3ToFloat(code), scale);
}

// AdamW's second moment v in fp8 state is stored as its square root: the
// codes and the block scale hold q = sqrt(v) (scale = absmax(q) / 448) and
// v = q * q. Linear v spans only e4m3's ~2.3e5 below the block's absmax, and
// v ~ g^2 has twice the dynamic range of the first moment m ~ g, so a small
// element's v would round to 0 while its m survives, and the next step with a
// zero grad (an embedding row absent from the batch) would move the param by
// step_size * m / eps. q has m's dynamic range and decays as beta2^(t/2)
// against m's beta1^t, so it outlives m instead.
MUOND_HD float SecondMomentRoot(float v) { return Sqrt(v); }
// The codes of q = sqrt(v): to nearest where e4m3 is normal; below that, where
// nearest could halve q or flush it to 0, rounded up, so a nonzero q never
// codes as 0 and the step's divisor sqrt(v) + eps is never below the true one.
// Else a spike of |g| ~ 1e7 in a block (q's span past e4m3's 2^-9 / 448) zeroes
// its neighbours' q while their m lives on, and they move by step_size * m /
// eps; rounded up they move less than fp32 state would, until the spike's q
// decays.
inline constexpr float kE4M3MinNormal = 0.015625f;  // 2^-6
MUOND_HD uint8_t QuantizeSecondMomentRoot(float q, float scale) {
  if (scale == 0.0f) return 0;
  const float x = Div(q, scale);
  uint8_t code = FloatToE4M3(x);
  if (q > 0.0f && x < kE4M3MinNormal && (code == 0 || E4M3ToFloat(code) < x)) {
    ++code;
  }
  return code;
}
MUOND_HD float DequantizeSecondMoment(uint8_t code, float scale) {
  const float q = DequantizeE4M3(code, scale);
  return Mul(q, q);
}

}  // namespace ew
}  // namespace muond
