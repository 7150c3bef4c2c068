#pragma once
// Shared by HostRef and CudaRef (client/cpp/client.h): checking a 1-D/2-D
// view and writing it as a TensorRef into a region.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"

namespace muond {

// Checks a 1-D/2-D view (dims >= 1, one stride per dim, innermost stride 1)
// and returns the bytes from its first to one past its last element. Fills
// row-major strides when `strides` is empty. InvalidArgument otherwise.
absl::StatusOr<int64_t> ViewSpanBytes(v1::DType dtype,
                                      const std::vector<int64_t>& shape,
                                      std::vector<int64_t>* strides);

// The TensorRef of a view at `byte_offset` in region `region`.
v1::TensorRef MakeTensorRef(const std::string& region, uint64_t byte_offset,
                            v1::DType dtype, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides);

}  // namespace muond
