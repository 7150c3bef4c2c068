#include "core/comm/communicator.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"

namespace muond {
namespace {

absl::Status ValidateCounts(const char* param, absl::Span<const int64_t> counts,
                            int size, const void* buffer, int64_t* total) {
  if (static_cast<int>(counts.size()) != size) {
    return absl::InvalidArgumentError(absl::StrCat(
        param, " has ", counts.size(),
        " entries; it needs one per rank of the group (", size, ")"));
  }
  *total = 0;
  for (size_t p = 0; p < counts.size(); ++p) {
    if (counts[p] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          param, "[", p, "] = ", counts[p], "; counts must be >= 0"));
    }
    *total += counts[p];
  }
  if (*total > 0 && buffer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        param, " sum to ", *total, " elements but the buffer is null"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsCommunicationFailure(const absl::Status& st) {
  return absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st) ||
         absl::IsAborted(st);
}

absl::Status ValidateRankAndSize(int rank, int size) {
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("group size = ", size, "; it must be >= 1"));
  }
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank = ", rank, "; it must be in [0, size = ", size, ")"));
  }
  return absl::OkStatus();
}

std::string Communicator::ErrorContext(const char* backend,
                                       const char* op) const {
  return absl::StrCat(backend, " group '", name_, "' rank ", rank_, "/", size_,
                      ": ", op, ": ");
}

absl::Status Communicator::AllToAllV(const void* send,
                                     absl::Span<const int64_t> send_counts,
                                     void* recv,
                                     absl::Span<const int64_t> recv_counts,
                                     DType dtype) {
  int64_t send_total = 0;
  int64_t recv_total = 0;
  absl::Status st =
      ValidateCounts("send_counts", send_counts, size_, send, &send_total);
  if (st.ok()) {
    st = ValidateCounts("recv_counts", recv_counts, size_, recv, &recv_total);
  }
  if (st.ok() && send_counts[rank_] != recv_counts[rank_]) {
    st = absl::InvalidArgumentError(absl::StrCat(
        "send_counts[rank] = ", send_counts[rank_], " but recv_counts[rank] = ",
        recv_counts[rank_], "; a rank's block to itself must match"));
  }
  if (!st.ok()) {
    return WithContext(st,
                       absl::StrCat("all_to_allv in group '", name_, "': "));
  }
  return DoAllToAllV(send, send_counts, recv, recv_counts, dtype);
}

absl::Status Communicator::AllGather(const void* send, int64_t count,
                                     void* recv, DType dtype) {
  if (count < 0) {
    return absl::InvalidArgumentError(absl::StrCat("all_gather in group '",
                                                   name_, "': count = ", count,
                                                   "; it must be >= 0"));
  }
  if (count > 0 && (send == nullptr || recv == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("all_gather in group '", name_, "': count = ", count,
                     " but send or recv is null"));
  }
  return DoAllGather(send, count, recv, dtype);
}

absl::Status LocalCommunicator::Barrier() {
  if (aborted_) {
    return absl::AbortedError("local communicator: used after Abort()");
  }
  return absl::OkStatus();
}

absl::Status LocalCommunicator::DoAllToAllV(
    const void* send, absl::Span<const int64_t> send_counts, void* recv,
    absl::Span<const int64_t> /*recv_counts*/, DType dtype) {
  if (absl::Status st = Barrier(); !st.ok()) return st;
  const size_t bytes = static_cast<size_t>(send_counts[0]) * DTypeSize(dtype);
  if (bytes > 0 && send != recv) std::memcpy(recv, send, bytes);
  return absl::OkStatus();
}

absl::Status LocalCommunicator::DoAllGather(const void* send, int64_t count,
                                            void* recv, DType dtype) {
  if (absl::Status st = Barrier(); !st.ok()) return st;
  const size_t bytes = static_cast<size_t>(count) * DTypeSize(dtype);
  if (bytes > 0 && send != recv) std::memcpy(recv, send, bytes);
  return absl::OkStatus();
}

}  // namespace muond
