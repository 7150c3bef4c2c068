#pragma once
// An fp8 e4m3 state reference written independently of
// core/backend/elementwise_math.h: the codec by enumerating the 256 codes
// and picking the nearest (ties to the even mantissa), and Muon's momentum
// on blockwise-scaled state as plain loops (dequantize, fp32 EMA,
// requantize), and AdamW's on fp8 moments (the second moment v stored as
// the codes of sqrt(v), v = q * q), for the CPU backend's and the engine's
// tests.
#include <cmath>
#include <cstdint>
#include <vector>

namespace muond::testing {

// The value of an e4m3fn code by the format's definition (NaN for
// S.1111.111).
inline double RefE4M3Value(int code) {
  const int sign = code & 0x80 ? -1 : 1;
  const int e = (code >> 3) & 0xf, m = code & 7;
  if (e == 15 && m == 7) return NAN;
  if (e == 0) return sign * std::ldexp(m / 8.0, -6);
  return sign * std::ldexp(1.0 + m / 8.0, e - 7);
}

// Nearest code of x's sign (ties to the even mantissa); |x| >= 448 and
// infinities saturate to +-448; NaN gives 0x7f.
inline uint8_t RefE4M3Code(float x) {
  if (std::isnan(x)) return 0x7f;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(double(x));
  if (a >= 448.0) return uint8_t(sign | 0x7e);
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(RefE4M3Value(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return uint8_t(sign | best);
}

// torch.lerp's two-branch formula.
inline float RefLerp(float start, float end, float w) {
  const float diff = end - start;
  return std::fabs(w) < 0.5f ? start + w * diff : end - diff * (1.0f - w);
}

struct RefFp8State {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // one per 256 elements
};

inline std::vector<float> RefDequantize(const RefFp8State& s) {
  std::vector<float> v(s.codes.size());
  for (size_t e = 0; e < v.size(); ++e) {
    v[e] = float(RefE4M3Value(s.codes[e])) * s.scales[e / 256];
  }
  return v;
}

// Blockwise: scale = absmax / 448 (0: codes 0), code = nearest(v / scale).
inline RefFp8State RefQuantize(const std::vector<float>& v) {
  RefFp8State s;
  s.codes.resize(v.size());
  for (size_t b0 = 0; b0 < v.size(); b0 += 256) {
    const size_t end = std::min(v.size(), b0 + 256);
    float absmax = 0.0f;
    for (size_t e = b0; e < end; ++e)
      absmax = std::max(absmax, std::fabs(v[e]));
    const float scale = absmax / 448.0f;
    s.scales.push_back(scale);
    for (size_t e = b0; e < end; ++e) {
      s.codes[e] = scale == 0.0f ? 0 : RefE4M3Code(v[e] / scale);
    }
  }
  return s;
}

// One Muon momentum step on fp8 state: grad given flat (row-major), the new
// state and the NS input (from the unquantized new momentum).
inline RefFp8State RefMomentumStep(const RefFp8State& state,
                                   const std::vector<float>& grad, double beta,
                                   bool nesterov, std::vector<float>* out) {
  const float w_ema = float(1.0 - beta), w_nesterov = float(beta);
  std::vector<float> m = RefDequantize(state);
  out->resize(m.size());
  for (size_t e = 0; e < m.size(); ++e) {
    m[e] = RefLerp(m[e], grad[e], w_ema);
    (*out)[e] = nesterov ? RefLerp(grad[e], m[e], w_nesterov) : m[e];
  }
  return RefQuantize(m);
}

// AdamW's second moment: the state holds q = sqrt(v) blockwise, v = q * q.
inline std::vector<float> RefDequantizeSquared(const RefFp8State& s) {
  std::vector<float> v = RefDequantize(s);
  for (float& x : v) x = x * x;
  return v;
}
// Below e4m3's smallest normal (2^-6) a nonzero root takes the smallest code
// not below root / scale, so it never codes as 0 or below itself.
inline RefFp8State RefQuantizeRoot(std::vector<float> v) {
  for (float& x : v) x = std::sqrt(x);
  RefFp8State s = RefQuantize(v);
  for (size_t e = 0; e < v.size(); ++e) {
    const float scale = s.scales[e / 256];
    if (!(v[e] > 0.0f) || scale == 0.0f) continue;
    const float x = v[e] / scale;
    if (x >= std::ldexp(1.0f, -6) || RefE4M3Value(s.codes[e]) >= x) continue;
    for (int c = 0; c <= 8; ++c) {
      if (RefE4M3Value(c) >= x) {
        s.codes[e] = uint8_t(c);
        break;
      }
    }
  }
  return s;
}

// One AdamW step (torch.optim.AdamW's single-tensor order) on fp8 moments,
// the param updated in place from the unquantized new moments.
struct RefAdamWScalars {
  float param_decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
      bias_correction2_sqrt, eps;
};
inline void RefAdamWFp8Step(RefFp8State& exp_avg, RefFp8State& exp_avg_sq,
                            std::vector<float>& param,
                            const std::vector<float>& grad,
                            const RefAdamWScalars& s) {
  std::vector<float> m = RefDequantize(exp_avg),
                     v = RefDequantizeSquared(exp_avg_sq);
  for (size_t e = 0; e < param.size(); ++e) {
    const float g = grad[e];
    float p = param[e] * s.param_decay;
    m[e] = RefLerp(m[e], g, s.one_minus_beta1);
    v[e] = v[e] * s.beta2 + (s.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v[e]) / s.bias_correction2_sqrt + s.eps;
    param[e] = p + (-s.step_size) * (m[e] / denom);
  }
  exp_avg = RefQuantize(m);
  exp_avg_sq = RefQuantizeRoot(v);
}

}  // namespace muond::testing
