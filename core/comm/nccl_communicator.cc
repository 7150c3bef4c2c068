#include "core/comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

constexpr char kBackend[] = "nccl";
constexpr absl::Duration kPollPause = absl::Microseconds(50);

ncclDataType_t ToNccl(DType dtype) {
  return dtype == DType::kBFloat16 ? ncclBfloat16 : ncclFloat32;
}

absl::Status CudaError(const std::string& where, const char* call,
                       cudaError_t err) {
  return absl::InternalError(absl::StrCat(where, call,
                                          " failed: ", cudaGetErrorName(err),
                                          " (", cudaGetErrorString(err), ")"));
}

absl::Status NcclError(const std::string& where, const char* call,
                       ncclResult_t res, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  std::string msg = absl::StrCat(
      where, call, " failed: ", ncclGetErrorString(res),
      last && *last ? absl::StrCat(" (", last, ")") : std::string());
  // Remote and system errors mean a peer or the network went away.
  if (res == ncclRemoteError || res == ncclSystemError) {
    return absl::UnavailableError(msg);
  }
  if (res == ncclInvalidArgument || res == ncclInvalidUsage) {
    return absl::InvalidArgumentError(msg);
  }
  return absl::InternalError(msg);
}

absl::Status SetDevice(const std::string& where, int device) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return CudaError(where, "cudaSetDevice", err);
  return absl::OkStatus();
}

// Polls cudaStreamQuery until the stream drained or `deadline`.
// `extra_check` (may be empty) runs every round, e.g. NCCL's async error.
template <typename Check>
absl::Status PollStream(const std::string& where, cudaStream_t stream,
                        absl::Time deadline, Check&& extra_check) {
  while (true) {
    cudaError_t err = cudaStreamQuery(stream);
    if (err == cudaSuccess) return absl::OkStatus();
    if (err != cudaErrorNotReady) {
      return CudaError(where, "cudaStreamQuery", err);
    }
    RETURN_IF_ERROR(extra_check());
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          where,
          "stream work did not complete in time (a peer is dead or "
          "slow?)"));
    }
    absl::SleepFor(kPollPause);
  }
}

// A group of one on the device: cudaMemcpyAsync on the stream, no NCCL.
class NcclLocalCommunicator : public Communicator {
 public:
  NcclLocalCommunicator(cudaStream_t stream, int device, absl::Duration timeout)
      : Communicator(0, 1, "local"),
        stream_(stream),
        device_(device),
        timeout_(timeout) {}

  MemorySpace memory_space() const override { return MemorySpace::kDevice; }

  absl::Status Barrier() override { return Usable("barrier"); }

  absl::Status Wait() override {
    const std::string where = ErrorContext(kBackend, "wait");
    RETURN_IF_ERROR(Usable("wait"));
    RETURN_IF_ERROR(SetDevice(where, device_));
    return PollStream(where, stream_, absl::Now() + timeout_,
                      [] { return absl::OkStatus(); });
  }

  void Abort() override { aborted_ = true; }

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> /*recv_counts*/,
                           DType dtype) override {
    return Copy("all_to_allv", send, recv, send_counts[0], dtype);
  }

  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override {
    return Copy("all_gather", send, recv, count, dtype);
  }

 private:
  absl::Status Usable(const char* op) const {
    if (aborted_) {
      return absl::AbortedError(
          absl::StrCat(ErrorContext(kBackend, op), "communicator was aborted"));
    }
    return absl::OkStatus();
  }

  absl::Status Copy(const char* op, const void* send, void* recv, int64_t count,
                    DType dtype) {
    RETURN_IF_ERROR(Usable(op));
    const size_t bytes = static_cast<size_t>(count) * DTypeSize(dtype);
    if (bytes == 0 || send == recv) return absl::OkStatus();
    const std::string where = ErrorContext(kBackend, op);
    RETURN_IF_ERROR(SetDevice(where, device_));
    cudaError_t err =
        cudaMemcpyAsync(recv, send, bytes, cudaMemcpyDeviceToDevice, stream_);
    if (err != cudaSuccess) return CudaError(where, "cudaMemcpyAsync", err);
    return absl::OkStatus();
  }

  const cudaStream_t stream_;
  const int device_;
  const absl::Duration timeout_;
  std::atomic<bool> aborted_{false};
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(int rank, int size, std::string name, ncclComm_t comm,
                   cudaStream_t stream, int device, float* scratch,
                   absl::Duration timeout)
      : Communicator(rank, size, std::move(name)),
        comm_(comm),
        stream_(stream),
        device_(device),
        scratch_(scratch),
        timeout_(timeout) {}

  ~NcclCommunicator() override {
    absl::MutexLock lock(&mu_);
    (void)cudaSetDevice(device_);
    if (comm_ != nullptr) {
      // Finalize flushes outstanding work; if that does not finish in time
      // the communicator is aborted instead of blocking the destructor.
      const ncclResult_t res = ncclCommFinalize(comm_);
      const bool clean = (res == ncclSuccess || res == ncclInProgress) &&
                         PollComm("destroy", absl::Now() + timeout_).ok();
      if (comm_ != nullptr) {
        if (clean) {
          ncclCommDestroy(comm_);
        } else {
          ncclCommAbort(comm_);
        }
        comm_ = nullptr;
      }
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
  }

  MemorySpace memory_space() const override { return MemorySpace::kDevice; }

  absl::Status Barrier() override {
    {
      absl::MutexLock lock(&mu_);
      RETURN_IF_ERROR(Enqueue("barrier", [&] {
        return ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_,
                             stream_);
      }));
    }
    return Wait();
  }

  absl::Status Wait() override {
    absl::MutexLock lock(&mu_);
    const std::string where = ErrorContext(kBackend, "wait");
    RETURN_IF_ERROR(UsableLocked("wait"));
    RETURN_IF_ERROR(SetDevice(where, device_));
    absl::Status st = PollStream(
        where, stream_, absl::Now() + timeout_,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
          if (aborted_) return UsableLocked("wait");
          ncclResult_t state = ncclSuccess;
          ncclResult_t res = ncclCommGetAsyncError(comm_, &state);
          if (res != ncclSuccess) {
            return NcclError(where, "ncclCommGetAsyncError", res, comm_);
          }
          if (state != ncclSuccess && state != ncclInProgress) {
            return NcclError(where, "communicator", state, comm_);
          }
          return absl::OkStatus();
        });
    if (!st.ok()) AbortLocked(st);
    return st;
  }

  void Abort() override {
    aborted_ = true;
    // An operation in flight sees the flag in its poll loop and aborts.
    if (mu_.TryLock()) {
      AbortLocked(absl::CancelledError("Abort() called"));
      mu_.Unlock();
    }
  }

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override {
    absl::MutexLock lock(&mu_);
    const size_t elem = DTypeSize(dtype);
    const char* send_bytes = static_cast<const char*>(send);
    char* recv_bytes = static_cast<char*>(recv);
    std::vector<size_t> send_offset(size() + 1, 0), recv_offset(size() + 1, 0);
    for (int p = 0; p < size(); ++p) {
      send_offset[p + 1] = send_offset[p] + send_counts[p] * elem;
      recv_offset[p + 1] = recv_offset[p] + recv_counts[p] * elem;
    }
    const int me = rank();
    return Enqueue("all_to_allv", [&]() -> ncclResult_t {
      // The block to itself never leaves the device.
      if (send_counts[me] > 0 &&
          send_bytes + send_offset[me] != recv_bytes + recv_offset[me]) {
        if (cudaMemcpyAsync(recv_bytes + recv_offset[me],
                            send_bytes + send_offset[me],
                            send_counts[me] * elem, cudaMemcpyDeviceToDevice,
                            stream_) != cudaSuccess) {
          return ncclUnhandledCudaError;
        }
      }
      ncclResult_t res = ncclGroupStart();
      if (res != ncclSuccess) return res;
      for (int p = 0; p < size() && res == ncclSuccess; ++p) {
        if (p == me) continue;
        // A zero count on one side is zero on the other: both skip.
        if (send_counts[p] > 0) {
          res = ncclSend(send_bytes + send_offset[p], send_counts[p],
                         ToNccl(dtype), p, comm_, stream_);
        }
        if (res == ncclSuccess && recv_counts[p] > 0) {
          res = ncclRecv(recv_bytes + recv_offset[p], recv_counts[p],
                         ToNccl(dtype), p, comm_, stream_);
        }
      }
      ncclResult_t end = ncclGroupEnd();
      return res != ncclSuccess ? res : end;
    });
  }

  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override {
    absl::MutexLock lock(&mu_);
    if (count == 0) return UsableLocked("all_gather");
    return Enqueue("all_gather", [&] {
      return ncclAllGather(send, recv, count, ToNccl(dtype), comm_, stream_);
    });
  }

 private:
  absl::Status UsableLocked(const char* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (aborted_ || comm_ == nullptr) {
      return absl::AbortedError(
          absl::StrCat(ErrorContext(kBackend, op), "communicator was aborted",
                       broken_by_.empty() ? "" : ": ", broken_by_));
    }
    return absl::OkStatus();
  }

  // Issues NCCL calls (`issue` returns their combined result) and waits until
  // the non-blocking communicator has enqueued them on the stream.
  template <typename Issue>
  absl::Status Enqueue(const char* op, Issue&& issue)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    RETURN_IF_ERROR(UsableLocked(op));
    const std::string where = ErrorContext(kBackend, op);
    RETURN_IF_ERROR(SetDevice(where, device_));
    ncclResult_t res = issue();
    absl::Status st;
    if (res != ncclSuccess && res != ncclInProgress) {
      st = NcclError(where, op, res, comm_);
    } else {
      st = PollComm(op, absl::Now() + timeout_);
    }
    if (!st.ok()) AbortLocked(st);
    return st;
  }

  // Polls ncclCommGetAsyncError until it leaves ncclInProgress.
  absl::Status PollComm(const char* op, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::string where = ErrorContext(kBackend, op);
    while (true) {
      if (aborted_) return UsableLocked(op);
      ncclResult_t state = ncclInProgress;
      ncclResult_t res = ncclCommGetAsyncError(comm_, &state);
      if (res != ncclSuccess) {
        return NcclError(where, "ncclCommGetAsyncError", res, comm_);
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return NcclError(where, op, state, comm_);
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(where, "NCCL still in progress after the timeout"));
      }
      absl::SleepFor(kPollPause);
    }
  }

  void AbortLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    aborted_ = true;
    if (broken_by_.empty()) broken_by_ = std::string(why.message());
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);
  const cudaStream_t stream_;
  const int device_;
  float* const scratch_;  // one float on the device, for Barrier
  const absl::Duration timeout_;
  std::atomic<bool> aborted_{false};
  std::string broken_by_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<ncclUniqueId> ExchangeUniqueId(KeyValueStore* store,
                                              const std::string& prefix,
                                              int rank, absl::Duration timeout,
                                              const std::string& where) {
  PrefixStore group_store(store, absl::StrCat(prefix, "/nccl"));
  ncclUniqueId id;
  if (rank == 0) {
    ncclResult_t res = ncclGetUniqueId(&id);
    if (res != ncclSuccess) {
      return NcclError(where, "ncclGetUniqueId", res, nullptr);
    }
    std::string encoded =
        absl::Base64Escape(absl::string_view(id.internal, sizeof(id.internal)));
    RETURN_IF_ERROR(group_store.Set("unique_id", encoded));
    return id;
  }
  absl::StatusOr<std::string> encoded = group_store.Get("unique_id", timeout);
  if (!encoded.ok()) {
    return WithContext(encoded.status(), where);
  }
  std::string raw;
  if (!absl::Base64Unescape(*encoded, &raw) ||
      raw.size() != sizeof(id.internal)) {
    return absl::DataLossError(
        absl::StrCat(where, "key '", prefix,
                     "/nccl/unique_id' does not hold a base64 NCCL "
                     "unique id of ",
                     sizeof(id.internal), " bytes"));
  }
  std::memcpy(id.internal, raw.data(), raw.size());
  return id;
}

}  // namespace

bool NcclAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) return false;
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess && version > 0;
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    KeyValueStore* store, const std::string& prefix, int rank, int size,
    void* stream, const NcclOptions& options) {
  RETURN_IF_ERROR(ValidateRankAndSize(rank, size));
  if (options.timeout < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NcclOptions.timeout = ", absl::FormatDuration(options.timeout),
        "; it must be >= 1ms"));
  }
  const std::string where = absl::StrCat(
      kBackend, " group '", prefix, "' rank ", rank, "/", size, ": init: ");
  int device = options.device;
  if (device < 0) {
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return CudaError(where, "cudaGetDevice", err);
  }
  RETURN_IF_ERROR(SetDevice(where, device));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (size == 1) {
    return std::unique_ptr<Communicator>(
        new NcclLocalCommunicator(cuda_stream, device, options.timeout));
  }
  if (store == nullptr) {
    return absl::InvalidArgumentError("store is null; size > 1 needs one");
  }

  CancellableStore cancellable(store, options.cancelled);
  ASSIGN_OR_RETURN(ncclUniqueId id, ExchangeUniqueId(&cancellable, prefix, rank,
                                                     options.timeout, where));
  float* scratch = nullptr;
  cudaError_t err = cudaMalloc(&scratch, sizeof(float));
  if (err != cudaSuccess) return CudaError(where, "cudaMalloc", err);
  cudaMemset(scratch, 0, sizeof(float));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t res = ncclCommInitRankConfig(&comm, size, id, rank, &config);
  absl::Status st;
  if (res != ncclSuccess && res != ncclInProgress) {
    st = NcclError(where, "ncclCommInitRankConfig", res, comm);
  } else {
    const absl::Time deadline = absl::Now() + options.timeout;
    while (true) {
      ncclResult_t state = ncclInProgress;
      res = ncclCommGetAsyncError(comm, &state);
      if (res != ncclSuccess) {
        st = NcclError(where, "ncclCommGetAsyncError", res, comm);
        break;
      }
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) {
        st = NcclError(where, "ncclCommInitRankConfig", state, comm);
        break;
      }
      if (options.cancelled && options.cancelled()) {
        st = absl::CancelledError(
            absl::StrCat(where, "stopped waiting for the ", size,
                         " ranks: the communicator creation was cancelled"));
        break;
      }
      if (absl::Now() >= deadline) {
        st = absl::DeadlineExceededError(
            absl::StrCat(where, "ncclCommInitRankConfig did not finish within ",
                         absl::FormatDuration(options.timeout), " (do all ",
                         size, " ranks join?)"));
        break;
      }
      absl::SleepFor(kPollPause);
    }
  }
  if (!st.ok()) {
    if (comm != nullptr) ncclCommAbort(comm);
    cudaFree(scratch);
    return st;
  }
  return std::unique_ptr<Communicator>(new NcclCommunicator(
      rank, size, prefix, comm, cuda_stream, device, scratch, options.timeout));
}

}  // namespace muond
