#pragma once
// --device check at muond startup, before it binds or joins.
#include "absl/status/status.h"

namespace muond {

// FailedPrecondition when the CUDA runtime sees no device or `device` is not
// in [0, count) (message names --device; see CheckCudaDeviceIndex).
absl::Status CheckCudaDevice(int device);

}  // namespace muond
