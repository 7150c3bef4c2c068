#include "server/daemon/exchange_counting.h"

#include <cstdint>
#include <utility>

#include "core/comm/delegating_communicator.h"

namespace muond {
namespace {

class CountingCommunicator final : public DelegatingCommunicator {
 public:
  CountingCommunicator(std::unique_ptr<Communicator> inner, Counter* sent,
                       Counter* received)
      : DelegatingCommunicator(std::move(inner)),
        sent_(sent),
        received_(received) {}

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override {
    absl::Status st = DelegatingCommunicator::DoAllToAllV(
        send, send_counts, recv, recv_counts, dtype);
    if (!st.ok()) return st;
    sent_->Increment(double(OthersBytes(send_counts, dtype)));
    received_->Increment(double(OthersBytes(recv_counts, dtype)));
    return st;
  }

 private:
  int64_t OthersBytes(absl::Span<const int64_t> counts, DType dtype) const {
    int64_t elements = 0;
    for (int p = 0; p < int(counts.size()); ++p) {
      if (p != rank()) elements += counts[p];
    }
    return elements * int64_t(DTypeSize(dtype));
  }

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
