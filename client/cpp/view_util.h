#pragma once
// Shared by HostRef and CudaRef: checks a 1-D/2-D view and returns the bytes
// from its first to one past its last element. Fills row-major strides when
// `strides` is empty.
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"

namespace muond {

absl::StatusOr<int64_t> ViewSpanBytes(v1::DType dtype,
                                      const std::vector<int64_t>& shape,
                                      std::vector<int64_t>* strides);

}  // namespace muond
