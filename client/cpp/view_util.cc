#include "client/cpp/view_util.h"

namespace muond {
namespace {

size_t ElementSize(v1::DType dtype) {
  return dtype == v1::DTYPE_BF16 || dtype == v1::DTYPE_FP16 ? 2 : 4;
}

}  // namespace

absl::StatusOr<int64_t> ViewSpanBytes(v1::DType dtype,
                                      const std::vector<int64_t>& shape,
                                      std::vector<int64_t>* strides) {
  if (shape.empty() || shape.size() > 2) {
    return absl::InvalidArgumentError("shape must be 1-D or 2-D");
  }
  if (strides->empty()) {
    *strides = shape.size() == 2 ? std::vector<int64_t>{shape[1], 1}
                                 : std::vector<int64_t>{1};
  }
  if (strides->size() != shape.size() || strides->back() != 1) {
    return absl::InvalidArgumentError(
        "strides must match shape and the innermost stride must be 1");
  }
  int64_t last = 0;  // element index of the last element
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 1)
      return absl::InvalidArgumentError("shape dims must be >= 1");
    last += (shape[d] - 1) * (*strides)[d];
  }
  return (last + 1) * int64_t(ElementSize(dtype));
}

v1::TensorRef MakeTensorRef(const std::string& region, uint64_t byte_offset,
                            v1::DType dtype, const std::vector<int64_t>& shape,
                            const std::vector<int64_t>& strides) {
  v1::TensorRef ref;
  ref.set_region(region);
  ref.set_byte_offset(byte_offset);
  ref.set_dtype(dtype);
  for (int64_t d : shape) ref.add_shape(d);
  for (int64_t s : strides) ref.add_strides(s);
  return ref;
}

}  // namespace muond
