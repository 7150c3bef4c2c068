#pragma once
// Validating a RegisterParamsRequest and binding it to trainer memory.
//
// BuildRegistration maps every declared memory region once (RegionTable:
// docs/ARCHITECTURE.md "Memory registration"), checks every TensorRef
// against the region it names and the sharding model, and returns views into
// the regions. On any error nothing stays mapped and the message names the
// group/param/field/region and the rule:
//   * job_id differs from the daemon's; no groups; empty or duplicate group
//     names; duplicate param names (across groups); unknown algorithm; a
//     client_id, group, domain, region or param name longer than
//     kMaxNameBytes (region_table.h);
//   * domain: sizes < 1, (g, t) outside it, G*T > world size, the same domain
//     name with different sizes or coordinates in two groups;
//   * full_shape not 1-D/2-D or a dim < 1; Muon params not 2-D; local shape
//     not following from full_shape, tags and domain (core/plan MakeShardSpec);
//   * regions: RegionTable::Map's rules (unnamed or repeated names, unknown
//     kind, byte_size 0 or > 2^48, aliased memory, an shm object missing,
//     empty, smaller than byte_size or owned by another user,
//     MEMORY_KIND_CUDA_IPC on a host-mode daemon);
// Names echoed in messages are bounded (core/common/echo.h).
//   * TensorRef: RegionTable::View's rules (unknown dtype, shape different
//     from the local shape, strides not matching shape, innermost stride
//     != 1, overflowing extents, a region not declared, a view that runs
//     past its region);
//   * grad shape different from the param's;
//   * aliasing: a param overlapping another param or any grad in memory
//     (view_overlap.h; grads may share memory with each other);
//   * `cancelled()` true after mapping (the trainer went away): Cancelled.
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/common/matrix_view.h"
#include "core/plan/sharding.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/memory_mapper.h"
#include "server/daemon/region_table.h"

namespace muond {

struct BoundParam {
  std::string name;
  std::vector<int64_t> full_shape;
  std::vector<int64_t> local_shape;
  ShardTags tags;
  MatrixView param;  // rows = 1 for 1-D tensors
  MatrixView grad;
};

struct BoundGroup {
  v1::ParamGroup proto;  // hyperparameters and domain (params cleared)
  std::vector<BoundParam> params;
};

struct Registration {
  std::string client_id;
  std::vector<BoundGroup> groups;
  int num_params = 0;
  // Every bound param's name, once: a step's skip_params are checked against
  // it (rebuilding it per step cost O(params) string copies).
  std::set<std::string> param_names;
  // The mapped regions every view above points into.
  RegionTable regions;

  // OK while every shm region still covers its registered byte_size; the
  // daemon calls it before every step. A trainer that shrinks (ftruncate)
  // a registered shm object would otherwise make the step's first touch of
  // a page past the new end raise SIGBUS and kill the daemon.
  // FailedPrecondition naming the region, the object and both sizes.
  //
  // Residual window: the trainer can still shrink the object between this
  // one fstat per region and the step's last touch; that crashes its own
  // daemon (a trainer racing its own optimizer step), never another user's
  // job. Closing it would need a SIGBUS handler that siglongjmps out of the
  // step, and that is not reasonable here: the faulting access happens on
  // any thread (OpenMP workers of the CPU kernels, Gloo's threads), a
  // handler cannot unwind another thread's locks, allocations and
  // half-written buffers, and jumping out of a kernel leaves the step
  // half-applied, which is exactly what the step must never be. Sealing
  // (F_SEAL_SHRINK) only exists for memfd, not POSIX shm objects.
  absl::Status RecheckMemory() const;

  // The manifest the coordinator plans from.
  v1::PublishManifestRequest Manifest(const std::string& job_id,
                                      int rank) const;
};

struct RegistrationLimits {
  std::string job_id;
  int world_size = 1;
};

absl::StatusOr<std::unique_ptr<Registration>> BuildRegistration(
    const v1::RegisterParamsRequest& request, const RegistrationLimits& limits,
    HandleOpener& opener, const std::function<bool()>& cancelled = {});

// Whether the daemon's refusal of a RegisterParams ends the job's round (the
// daemon tells the coordinator, which refuses the round on every rank): a
// request for this daemon's job (`job_id`) refused by a check of the request
// itself (a bad view, region, shape, tag or hyperparameter). Not a wrong job
// id (not this job's registration), a permission failure or a trainer that
// hung up.
bool RefusalEndsTheRound(const absl::Status& refusal,
                         const v1::RegisterParamsRequest& request,
                         const std::string& job_id);

}  // namespace muond
