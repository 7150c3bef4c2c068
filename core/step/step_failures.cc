#include "core/step/step_failures.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace muond {

absl::Status DidNotJoin(const absl::Status& st, const std::string& who,
                        int64_t step_id, const std::string& phase,
                        absl::Duration waited) {
  if (!absl::IsDeadlineExceeded(st)) return st;
  return absl::DeadlineExceededError(absl::StrFormat(
      "%s did not join step %d within %.0f s (%s): its trainer has not called "
      "Step, or it is hung (%s)",
      who, step_id, absl::ToDoubleSeconds(waited), phase, st.message()));
}

std::string MissingPeer(const Communicator& comm, const char* of) {
  if (comm.size() == 2)
    return absl::StrCat("rank ", 1 - comm.rank(), " of ", of);
  return absl::StrCat("a rank of ", of, " (", comm.size(), " ranks)");
}

absl::Status NonFiniteError(const std::vector<std::string>& bad) {
  return absl::InvalidArgumentError(absl::StrCat(
      "non-finite gradients (NaN or Inf) in: ", absl::StrJoin(bad, ", "),
      " (group/param); the step was not applied: fix or zero those "
      "gradients and send the step again (muond-daemon --skip_nonfinite "
      "skips such steps instead)"));
}

absl::Status CommunicatorFirst::Take(absl::Status status) {
  if (!IsCommunicationFailure(status)) return status;
  if (failure_.ok()) failure_ = std::move(status);
  return absl::OkStatus();
}

}  // namespace muond
