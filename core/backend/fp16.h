#pragma once
// IEEE binary16 (fp16) <-> fp32 conversion for the CPU backend (plain header:
// no absl, compiles under nvcc and g++). fp16 is internal only: the iteration
// dtype of Gram Newton–Schulz (core/muon/gram_newton_schulz.h).
//
// fp32 -> fp16 rounds to nearest, ties to even (cuda_fp16.h's
// __float2half_rn, torch's .half()): |x| >= 65520 (halfway past the max
// 65504) becomes +-inf, values below 2^-14 become subnormals (multiples of
// 2^-24), NaN stays a quiet NaN with its sign. fp16 -> fp32 is exact.
#include <cstdint>

#include "core/backend/bf16.h"  // FloatBits, BitsToFloat, MUOND_HD

namespace muond {

MUOND_HD uint16_t FloatToFp16Bits(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u |
                                 (abs > 0x7f800000u ? 0x0200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {  // below 2^-14: subnormal (or zero) in fp16
    // Value = mant24 * 2^(e-150); the fp16 subnormal unit is 2^-24, so shift
    // the 24-bit significand right by (126 - e) with round-to-nearest-even.
    const int e = static_cast<int>(abs >> 23);
    if (e < 102) return sign;  // < 2^-25: rounds to zero (ties below too)
    const uint32_t mant = (abs & 0x007fffffu) | 0x00800000u;
    const int shift = 126 - e;  // 14..24
    const uint32_t half = 1u << (shift - 1);
    const uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t q = mant >> shift;
    if (rest > half || (rest == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 23-bit mantissa to
  // 10 bits; a carry out of the mantissa correctly bumps the exponent.
  const uint32_t lsb = (abs >> 13) & 1u;
  const uint32_t r = (abs - 0x38000000u + 0x0fffu + lsb) >> 13;
  return static_cast<uint16_t>(sign | r);
}

MUOND_HD float Fp16BitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x03ffu;
  if (exp == 0x1fu) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  // Subnormal: mant * 2^-24, exact in fp32.
  const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
  return sign ? -v : v;
}

// fp32 -> fp16 -> fp32: the value an fp16 store keeps.
MUOND_HD float RoundToFp16(float f) {
  return Fp16BitsToFloat(FloatToFp16Bits(f));
}

}  // namespace muond
