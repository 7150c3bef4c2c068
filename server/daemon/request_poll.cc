#include "server/daemon/request_poll.h"

namespace muond {

void RequestPoll::Arrived(Clock::time_point at) {
  if (last_.has_value()) interval_ = at - *last_;
  last_ = at;
  spent_ = false;
}

std::optional<RequestPoll::Window> RequestPoll::Next() const {
  if (poll_ == Clock::duration::zero() || spent_ || !last_.has_value() ||
      interval_ / 2 < poll_) {
    return std::nullopt;
  }
  const Clock::time_point due = *last_ + interval_;
  return Window{due - poll_, due + poll_};
}

}  // namespace muond
