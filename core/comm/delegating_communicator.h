#pragma once
// DelegatingCommunicator: a Communicator whose every call goes to another,
// for wrappers that change one behaviour and keep the rest (the daemon's
// exchange byte counters; tests that count or fail collectives).
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/comm/communicator.h"

namespace muond {

// Hands every call to `inner`; subclass it and override the collectives
// (DoAllToAllV, DoAllGather) or Wait where a test changes them.
class DelegatingCommunicator : public Communicator {
 public:
  explicit DelegatingCommunicator(std::unique_ptr<Communicator> inner)
      : Communicator(inner->rank(), inner->size(), inner->name()),
        inner_(std::move(inner)) {}
  MemorySpace memory_space() const override { return inner_->memory_space(); }
  absl::Status Barrier() override { return inner_->Barrier(); }
  absl::Status Wait() override { return inner_->Wait(); }
  void Abort() override { inner_->Abort(); }

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override {
    return inner_->AllToAllV(send, send_counts, recv, recv_counts, dtype);
  }
  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override {
    return inner_->AllGather(send, count, recv, dtype);
  }

 private:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace muond
