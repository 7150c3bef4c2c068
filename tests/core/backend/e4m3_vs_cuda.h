#pragma once
// The codec of core/backend/elementwise_math.h against CUDA's own e4m3
// conversions (cuda_fp8.h, __NV_SATFINITE: what __nv_fp8_e4m3 does), run on
// the device. Plain header: no CUDA types.
#include <cstdint>

namespace muond::testing {

struct E4M3Mismatches {
  uint64_t encode = 0;      // fp32 bit patterns encoded differently
  uint32_t first_bits = 0;  // one of them
  uint32_t decode = 0;      // codes decoded differently
  int error = 0;            // the cudaError_t of the runs
};

// Every fp32 bit pattern encoded (a NaN may become either NaN code) and
// every code decoded, ours against CUDA's.
E4M3Mismatches CompareE4M3WithCuda();

}  // namespace muond::testing
