#include "server/daemon/exchange_counting.h"

#include <cstdint>
#include <utility>

namespace muond {
namespace {

class CountingCommunicator : public Communicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> inner, Counter* sent,
                       Counter* received)
      : Communicator(inner->rank(), inner->size(), inner->name()),
        inner_(std::move(inner)),
        sent_(sent),
        received_(received) {}

  MemorySpace memory_space() const override { return inner_->memory_space(); }
  absl::Status Barrier() override { return inner_->Barrier(); }
  absl::Status Wait() override { return inner_->Wait(); }
  void Abort() override { inner_->Abort(); }

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override {
    absl::Status st =
        inner_->AllToAllV(send, send_counts, recv, recv_counts, dtype);
    if (!st.ok()) return st;
    sent_->Increment(double(OthersBytes(send_counts, dtype)));
    received_->Increment(double(OthersBytes(recv_counts, dtype)));
    return st;
  }
  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override {
    return inner_->AllGather(send, count, recv, dtype);
  }

 private:
  int64_t OthersBytes(absl::Span<const int64_t> counts, DType dtype) const {
    int64_t elements = 0;
    for (int p = 0; p < int(counts.size()); ++p) {
      if (p != rank()) elements += counts[p];
    }
    return elements * int64_t(DTypeSize(dtype));
  }

  const std::unique_ptr<Communicator> inner_;
  Counter* const sent_;
  Counter* const received_;
};

}  // namespace

std::unique_ptr<Communicator> CountingExchangeBytes(
    std::unique_ptr<Communicator> inner, Counter* sent, Counter* received) {
  return std::make_unique<CountingCommunicator>(std::move(inner), sent,
                                                received);
}

}  // namespace muond
