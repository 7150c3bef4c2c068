#pragma once
// The collective operations the layer-sharded step needs, over one group of
// ranks (a gtp_remat group or a tp group of a domain). Backends: Gloo (host
// memory, CPU mode), NCCL (device memory) and LocalCommunicator (size 1: no
// communication at all).
//
// Every rank of the group must issue the same operations in the same order.
// One operation at a time per communicator; calls are serialized internally.
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/common/dtype.h"

namespace muond {

// Where the buffers handed to a communicator live.
enum class MemorySpace { kHost, kDevice };

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The group's store prefix (or "local"); every error message names it.
  const std::string& name() const { return name_; }
  virtual MemorySpace memory_space() const = 0;

  // All-to-all with per-peer counts, in elements of `dtype`. `send` holds the
  // blocks for peers 0..size-1 packed contiguously in rank order,
  // send_counts[p] elements for peer p; `recv` receives the block from peer p
  // at offset sum(recv_counts[0..p)). recv_counts[p] must equal what peer p
  // sends to this rank (not checkable locally); send_counts[rank()] must equal
  // recv_counts[rank()]. Zero counts and null buffers with a zero total are
  // fine. Buffers must not overlap. Errors: InvalidArgument for bad counts;
  // DeadlineExceeded / Unavailable naming the group and the operation when a
  // peer is dead or slow; Aborted after Abort() or after an earlier failure
  // aborted the communicator (the daemon reads DeadlineExceeded, Unavailable
  // and Aborted as "a peer is gone": docs/ARCHITECTURE.md "Errors").
  absl::Status AllToAllV(const void* send,
                         absl::Span<const int64_t> send_counts, void* recv,
                         absl::Span<const int64_t> recv_counts, DType dtype);

  // recv[p * count .. (p + 1) * count) = `send` of rank p. Every rank passes
  // the same count (>= 0). Errors as AllToAllV.
  absl::Status AllGather(const void* send, int64_t count, void* recv,
                         DType dtype);

  // Returns once every rank of the group has entered the barrier (device
  // backends: once their barrier work completed on the stream).
  virtual absl::Status Barrier() = 0;

  // Blocks until every operation issued so far has completed. Host backends
  // complete each operation before it returns, so this is a no-op there;
  // device backends enqueue on their stream and this polls it, aborting the
  // communicator with DeadlineExceeded after the timeout (a dead peer hangs
  // device collectives forever otherwise).
  virtual absl::Status Wait() = 0;

  // Tears the communicator down: later operations fail with Aborted and peers
  // blocked on this rank see an error instead of waiting for their timeout.
  // Idempotent; safe to call from another thread.
  virtual void Abort() = 0;

 protected:
  Communicator(int rank, int size, std::string name)
      : rank_(rank), size_(size), name_(std::move(name)) {}

  // Called with validated arguments; counts as int64 per peer.
  virtual absl::Status DoAllToAllV(const void* send,
                                   absl::Span<const int64_t> send_counts,
                                   void* recv,
                                   absl::Span<const int64_t> recv_counts,
                                   DType dtype) = 0;
  virtual absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                                   DType dtype) = 0;

  // "<backend> group '<name>' rank r/size: <op>: " for error messages.
  std::string ErrorContext(const char* backend, const char* op) const;

 private:
  const int rank_;
  const int size_;
  const std::string name_;
};

// InvalidArgument unless 0 <= rank < size.
absl::Status ValidateRankAndSize(int rank, int size);

// A collective failure: a transport error or timeout of the communicator
// (Unavailable, DeadlineExceeded), or a communicator that an earlier failure
// aborted (Aborted). The engine and the daemon both classify by this one rule.
bool IsCommunicationFailure(const absl::Status& st);

// A group of one: copies send to recv with memcpy, talks to nobody. Host
// memory. (The device counterpart is CreateNcclCommunicator with size 1.)
class LocalCommunicator : public Communicator {
 public:
  LocalCommunicator() : Communicator(0, 1, "local") {}

  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  absl::Status Barrier() override;
  absl::Status Wait() override { return Barrier(); }
  void Abort() override { aborted_ = true; }

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override;
  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override;

 private:
  bool aborted_ = false;
};

}  // namespace muond
