#pragma once
// bfloat16 <-> fp32 conversion shared by the CPU backend and the CUDA kernels
// (plain header: no absl, compiles under nvcc and g++).
//
// fp32 -> bf16 rounds to nearest, ties to even (the rounding of
// torch.Tensor.to(torch.bfloat16) and of cuda_bf16.h's __float2bfloat16_rn);
// NaN stays a quiet NaN with its sign. bf16 -> fp32 is exact.
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MUOND_HD __host__ __device__ __forceinline__
#else
#define MUOND_HD inline
#endif

namespace muond {

MUOND_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MUOND_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Round-to-nearest-even fp32 -> bf16 bit pattern.
MUOND_HD uint16_t FloatToBf16Bits(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

MUOND_HD float Bf16BitsToFloat(uint16_t b) {
  return BitsToFloat(static_cast<uint32_t>(b) << 16);
}

// The smallest fp32 magnitude that rounds to inf in bf16: 0x7f7f8000
// (~3.3961514e38), halfway between the bf16 max 0x7f7f and inf; ties go to
// the even neighbour, inf. |x| < this rounds to a finite bf16.
constexpr uint32_t kBf16OverflowThresholdBits = 0x7f7f8000u;

// fp32 -> bf16 -> fp32: the value a bf16 store keeps.
MUOND_HD float RoundToBf16(float f) {
  return Bf16BitsToFloat(FloatToBf16Bits(f));
}

}  // namespace muond
