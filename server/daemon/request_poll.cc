#include "server/daemon/request_poll.h"

namespace muond {

void RequestPoll::Arrived(Clock::time_point at) {
  if (arrived_.has_value()) interval_ = at - *arrived_;
  if (answered_.has_value() && arrived_.has_value() &&
      *answered_ >= *arrived_) {
    turn_ = std::max(at - *answered_, Clock::duration::zero());
  }
  arrived_ = at;
  spent_ = false;
}

std::optional<RequestPoll::Window> RequestPoll::Next() const {
  // A turn is measured only once a request and its answer were seen.
  if (poll_ == Clock::duration::zero() || spent_ || !turn_.has_value() ||
      *answered_ < *arrived_ || interval_ / 2 < poll_) {
    return std::nullopt;
  }
  const Clock::time_point due = *answered_ + *turn_;
  return Window{due - poll_, due + poll_};
}

}  // namespace muond
