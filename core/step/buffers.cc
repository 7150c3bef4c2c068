#include "core/step/buffers.h"

#include <algorithm>
#include <cstring>

#include "core/common/status_macros.h"

namespace muond {

OwnedBuffer& OwnedBuffer::operator=(OwnedBuffer&& o) noexcept {
  Reset();
  backend_ = o.backend_;
  data_ = o.data_;
  location_ = o.location_;
  o.data_ = nullptr;
  return *this;
}

void OwnedBuffer::Reset() {
  if (data_ == nullptr) return;
  if (location_ == StateLocation::kHost) {
    backend_->FreeHost(data_);
  } else {
    backend_->Free(data_);
  }
  data_ = nullptr;
}

absl::StatusOr<OwnedBuffer> AllocateZeroed(Backend* backend, DType dtype,
                                           int64_t rows, int64_t cols,
                                           StateLocation location) {
  const int64_t bytes = std::max<int64_t>(rows * cols, 1) * DTypeSize(dtype);
  if (location == StateLocation::kHost) {
    ASSIGN_OR_RETURN(void* data, backend->AllocateHost(bytes));
    // Host memory: zeroed here, not by a device call.
    std::memset(data, 0, size_t(bytes));
    return OwnedBuffer(backend, data, location);
  }
  ASSIGN_OR_RETURN(void* data, backend->Allocate(bytes));
  OwnedBuffer buffer(backend, data);
  if (rows * cols > 0) {
    RETURN_IF_ERROR(backend->Memset0(ContiguousView(data, dtype, rows, cols)));
  }
  return buffer;
}

absl::StatusOr<std::vector<MatrixView>> AllocateSlabs(
    Backend* backend, DType dtype,
    const std::vector<std::pair<int64_t, int64_t>>& shapes,
    std::vector<OwnedBuffer>& owned) {
  // Shapes in first-appearance order, each with its entries.
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<size_t>>>
      by_shape;
  for (size_t i = 0; i < shapes.size(); ++i) {
    auto it = std::find_if(by_shape.begin(), by_shape.end(),
                           [&](const auto& e) { return e.first == shapes[i]; });
    if (it == by_shape.end()) {
      by_shape.push_back({shapes[i], {i}});
    } else {
      it->second.push_back(i);
    }
  }
  std::vector<MatrixView> views(shapes.size());
  for (const auto& [shape, members] : by_shape) {
    const auto [rows, cols] = shape;
    ASSIGN_OR_RETURN(
        OwnedBuffer buf,
        AllocateZeroed(backend, dtype, int64_t(members.size()) * rows, cols));
    char* base = static_cast<char*>(buf.data());
    const int64_t bytes = rows * cols * int64_t(DTypeSize(dtype));
    for (size_t k = 0; k < members.size(); ++k) {
      views[members[k]] =
          ContiguousView(base + int64_t(k) * bytes, dtype, rows, cols);
    }
    owned.push_back(std::move(buf));
  }
  return views;
}

absl::Status ExchangeBuffers::Reserve(Backend* backend, int64_t send_bytes,
                                      int64_t recv_bytes) {
  // Allocated as bf16 (2-byte) elements: the smallest exchanged dtype.
  if (send_bytes > send_bytes_) {
    ASSIGN_OR_RETURN(send_, AllocateZeroed(backend, DType::kBFloat16, 1,
                                           (send_bytes + 1) / 2));
    send_bytes_ = send_bytes;
  }
  if (recv_bytes > recv_bytes_) {
    ASSIGN_OR_RETURN(recv_, AllocateZeroed(backend, DType::kBFloat16, 1,
                                           (recv_bytes + 1) / 2));
    recv_bytes_ = recv_bytes;
  }
  return absl::OkStatus();
}

}  // namespace muond
