#pragma once
// Device-memory communicator over NCCL. This header carries no CUDA types
// (streams are void*), so callers compile without the CUDA headers; CUDA and
// NCCL stay inside nccl_communicator.cc.
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/comm/communicator.h"
#include "core/comm/kv_store.h"

namespace muond {

struct NcclOptions {
  // Bounds the unique-id hand-over, communicator init, each enqueue and
  // Wait(); past it the communicator is aborted (ncclCommAbort) and the call
  // returns DeadlineExceeded.
  absl::Duration timeout = absl::Seconds(60);
  // CUDA device the communicator lives on; -1: the current device at creation.
  // It is made current around every call.
  int device = -1;
  // Polled while waiting for peers (unique id, communicator init); once it
  // returns true the creation stops with Cancelled instead of waiting out
  // the timeout. Unset: never cancelled.
  std::function<bool()> cancelled;
};

// True when a CUDA device is visible and the NCCL library answers.
bool NcclAvailable();

// Joins the group of `size` ranks under `prefix` in `store`: rank 0 generates
// the NCCL unique id and sets "<prefix>/nccl/unique_id" (base64), the others
// Get it; then a non-blocking ncclCommInitRankConfig, polled up to the
// timeout. `stream` is the group's cudaStream_t (owned by the CUDA backend,
// must outlive the communicator); every operation is enqueued on it and
// returns once enqueued: call Wait() (or synchronize the stream) before
// reading results. All buffers are device memory. size 1 does no
// communication and never touches the store: copies are cudaMemcpyAsync on
// the stream. Errors: InvalidArgument, DeadlineExceeded naming the key or the
// init step, Unavailable/Internal with NCCL's or CUDA's message.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    KeyValueStore* store, const std::string& prefix, int rank, int size,
    void* stream, const NcclOptions& options = {});

}  // namespace muond
