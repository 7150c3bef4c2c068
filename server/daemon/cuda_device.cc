#include "server/daemon/cuda_device.h"

#include <cuda_runtime_api.h>

#include <string>

#include "server/common/cli.h"

namespace muond {

absl::Status CheckCudaDevice(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  return CheckCudaDeviceIndex(
      device, err == cudaSuccess ? count : 0,
      err == cudaSuccess ? std::string() : cudaGetErrorString(err));
}

}  // namespace muond
