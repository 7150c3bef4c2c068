#pragma once
// The rendezvous key/value store of every job (NCCL unique ids, Gloo
// addresses), with the limits that keep any client from growing the
// coordinator without bound. Not thread-safe: CoordinatorCore calls it under
// its mutex (and waits for keys on that mutex).
#include <cstdint>

#include "absl/status/status.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/job.h"

namespace muond {

// Bounds of the rendezvous store, so no client can grow the coordinator
// without limit (ResourceExhausted naming the limit). NCCL stores a 128-byte
// unique id per communicator, Gloo one address list per rank (about 100
// bytes per peer): 1 MiB per value holds thousands of ranks.
struct KvLimits {
  int64_t max_key_bytes = 1024;
  int64_t max_value_bytes = 1 << 20;
  int64_t max_keys_per_job = 1 << 16;
  // Keys plus values over every job of the coordinator.
  int64_t max_total_bytes = int64_t(256) << 20;
};

class KvStore {
 public:
  explicit KvStore(KvLimits limits) : limits_(limits) {}

  // The checks of a KvSet that need no job: InvalidArgument for a job id
  // CheckCoordinatorJobId refuses or an empty key; ResourceExhausted naming
  // kv_max_key_bytes or kv_max_value_bytes.
  absl::Status CheckSet(const v1::KvSetRequest& request) const;
  // Stores the pair in `kv` (a request CheckSet accepted). ResourceExhausted
  // naming kv_max_keys_per_job or kv_max_total_bytes; nothing stored then.
  absl::Status Set(JobKv& kv, const v1::KvSetRequest& request);
  // Drops a job's keys (their bytes leave the total).
  void Clear(JobKv& kv);

  // InvalidArgument: an empty key or a negative timeout_ms.
  static absl::Status CheckGet(const v1::KvGetRequest& request);

 private:
  const KvLimits limits_;
  // Keys plus values over every job.
  int64_t total_bytes_ = 0;
};

}  // namespace muond
