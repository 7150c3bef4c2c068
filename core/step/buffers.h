#pragma once
// Backend memory the step engine owns: state tensors, the L_i slabs, the
// assembled matrices of a plan and each lane's exchange buffers.
//
// Every buffer is allocated once (at Create, or when a new plan needs more)
// and reused every step; nothing in the step path allocates.
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/common/dtype.h"
#include "core/common/matrix_view.h"
#include "core/common/state_storage.h"

namespace muond {

// Backend memory (Allocate, or AllocateHost where `location` is kHost), freed
// with the backend that allocated it. Move-only.
class OwnedBuffer {
 public:
  OwnedBuffer() = default;
  OwnedBuffer(Backend* backend, void* data,
              StateLocation location = StateLocation::kDevice)
      : backend_(backend), data_(data), location_(location) {}
  OwnedBuffer(OwnedBuffer&& o) noexcept { *this = std::move(o); }
  OwnedBuffer& operator=(OwnedBuffer&& o) noexcept;
  ~OwnedBuffer() { Reset(); }
  void* data() const { return data_; }

 private:
  void Reset();
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  StateLocation location_ = StateLocation::kDevice;
};

// A zeroed rows x cols `dtype` buffer (at least one element, so an empty
// matrix still has a distinct non-null address), in the backend's memory or,
// for kHost, in host memory its calls reach in place (AllocateHost).
absl::StatusOr<OwnedBuffer> AllocateZeroed(
    Backend* backend, DType dtype, int64_t rows, int64_t cols,
    StateLocation location = StateLocation::kDevice);

// Zeroed `dtype` matrices of the given (rows, cols) shapes, each shape's
// matrices laid out back to back in one slab in list order, so a run of
// same-shape matrices (the chunks NsRunner batches) is one contiguous stacked
// view that batched NS works on in place. Returns one view per entry of
// `shapes`; the slabs are appended to `owned`.
absl::StatusOr<std::vector<MatrixView>> AllocateSlabs(
    Backend* backend, DType dtype,
    const std::vector<std::pair<int64_t, int64_t>>& shapes,
    std::vector<OwnedBuffer>& owned);

// The send and receive buffers of one lane's all_to_allv exchanges, in raw
// bytes (the groups of a lane may exchange different dtypes). They only grow:
// sized by the largest plan any group of the lane has used.
class ExchangeBuffers {
 public:
  // Grows either buffer to at least the given bytes. On error each buffer
  // is still at least as large as before, so the current plan still runs.
  absl::Status Reserve(Backend* backend, int64_t send_bytes,
                       int64_t recv_bytes);
  char* send() const { return static_cast<char*>(send_.data()); }
  char* recv() const { return static_cast<char*>(recv_.data()); }
  int64_t send_bytes() const { return send_bytes_; }
  int64_t recv_bytes() const { return recv_bytes_; }

 private:
  OwnedBuffer send_, recv_;
  int64_t send_bytes_ = 0, recv_bytes_ = 0;
};

}  // namespace muond
