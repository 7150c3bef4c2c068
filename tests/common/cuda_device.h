#pragma once
// The one CUDA device check of the C++ GPU tests: a GPU test calls
//   if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
// so that it reports skipped, not failed, on a host without a GPU.
#include <cuda_runtime.h>

namespace muond::testing {

// The CUDA devices this process sees. 0 when the runtime reports an error:
// without a driver or a device cudaGetDeviceCount fails rather than
// returning 0, and both mean "skip".
inline int CudaDeviceCount() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

inline bool HaveCudaDevice() { return CudaDeviceCount() > 0; }

}  // namespace muond::testing
