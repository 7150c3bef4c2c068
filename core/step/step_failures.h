#pragma once
// How a step names its failures: communicator failures, the peer a timed-out
// collective waited for, non-finite gradients. Shared by the job vote and the
// domain agreements of one step (layer_sharded_muon_impl.h).
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/comm/communicator.h"

namespace muond {

// A collective of `phase` that timed out: a rank never arrived. Says who
// (`who`), which step and phase and how long this rank waited, keeping the
// code (DeadlineExceeded: the daemon answers PEER_GONE) and the transport's
// text. Any other status is returned as it is.
absl::Status DidNotJoin(const absl::Status& st, const std::string& who,
                        int64_t step_id, const std::string& phase,
                        absl::Duration waited);

// The peer a timed-out collective of `comm` waited for: known for two ranks.
std::string MissingPeer(const Communicator& comm, const char* of);

// The failures of work that runs on after a local failure (its collectives
// are awaited by peers that do not know it) but stops at a communicator's
// (the next collective would only wait out one more timeout). Take() keeps
// the first communicator failure and hands a local one back; that failure,
// once there, decides the step ahead of any local one (a timeout abandons
// it).
class CommunicatorFirst {
 public:
  // `status` where it is local (or OK); a communicator failure is kept (the
  // first) and OK returned.
  absl::Status Take(absl::Status status);
  bool failed() const { return !failure_.ok(); }
  // The communicator failure where there was one, else `local`.
  absl::Status Or(absl::Status local) const {
    return failed() ? failure_ : local;
  }

 private:
  absl::Status failure_;
};

// InvalidArgument naming the params whose gradients are not finite.
absl::Status NonFiniteError(const std::vector<std::string>& bad);

}  // namespace muond
