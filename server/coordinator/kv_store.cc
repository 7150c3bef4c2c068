#include "server/coordinator/kv_store.h"

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "server/common/job_id.h"

namespace muond {
namespace {

absl::Status Exhausted(const v1::KvSetRequest& request, const char* limit,
                       int64_t value, int64_t max) {
  return absl::ResourceExhaustedError(
      absl::StrCat("KvSet of job '", request.job_id(), "': ", limit, "=", max,
                   " exceeded (", value, ")"));
}

}  // namespace

absl::Status KvStore::CheckSet(const v1::KvSetRequest& request) const {
  RETURN_IF_ERROR(
      CheckCoordinatorJobId("job_id", request.job_id()));  // errors quote it
  if (request.key().empty()) {
    return absl::InvalidArgumentError("key: must not be empty");
  }
  const int64_t key_bytes = request.key().size();
  const int64_t value_bytes = request.value().size();
  if (key_bytes > limits_.max_key_bytes) {
    return Exhausted(request, "kv_max_key_bytes", key_bytes,
                     limits_.max_key_bytes);
  }
  if (value_bytes > limits_.max_value_bytes) {
    return Exhausted(request, "kv_max_value_bytes", value_bytes,
                     limits_.max_value_bytes);
  }
  return absl::OkStatus();
}

absl::Status KvStore::Set(JobKv& kv, const v1::KvSetRequest& request) {
  const int64_t key_bytes = request.key().size();
  const int64_t value_bytes = request.value().size();
  auto it = kv.entries.find(request.key());
  const int64_t old_bytes =
      it == kv.entries.end() ? 0 : key_bytes + int64_t(it->second.size());
  if (it == kv.entries.end() &&
      int64_t(kv.entries.size()) >= limits_.max_keys_per_job) {
    return Exhausted(request, "kv_max_keys_per_job", kv.entries.size() + 1,
                     limits_.max_keys_per_job);
  }
  const int64_t total = total_bytes_ - old_bytes + key_bytes + value_bytes;
  if (total > limits_.max_total_bytes) {
    return Exhausted(request, "kv_max_total_bytes", total,
                     limits_.max_total_bytes);
  }
  kv.entries[request.key()] = request.value();
  kv.bytes += key_bytes + value_bytes - old_bytes;
  total_bytes_ = total;
  return absl::OkStatus();
}

void KvStore::Clear(JobKv& kv) {
  total_bytes_ -= kv.bytes;
  kv.bytes = 0;
  kv.entries.clear();
}

absl::Status KvStore::CheckGet(const v1::KvGetRequest& request) {
  if (request.key().empty()) {
    return absl::InvalidArgumentError("key: must not be empty");
  }
  if (request.timeout_ms() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_ms: ", request.timeout_ms(), " must be >= 0"));
  }
  return absl::OkStatus();
}

}  // namespace muond
