#pragma once
// Validating a RegisterParamsRequest and binding it to trainer memory.
//
// BuildRegistration maps every declared memory region once (RegionTable:
// docs/ARCHITECTURE.md "Memory registration"), checks every TensorRef
// against the region it names and the sharding model, and returns views into
// the regions. On any error nothing stays mapped and the message names the
// group/param/field/region and the rule:
//   * job_id differs from the daemon's; no groups; empty or duplicate group
//     names; duplicate param names (across groups); unknown algorithm;
//   * domain: sizes < 1, (g, t) outside it, G*T > world size, the same domain
//     name with different sizes or coordinates in two groups;
//   * full_shape not 1-D/2-D or a dim < 1; Muon params not 2-D; local shape
//     not following from full_shape, tags and domain (core/plan MakeShardSpec);
//   * regions: RegionTable::Map's rules (unnamed or repeated names, unknown
//     kind, byte_size 0, aliased memory, an shm object missing, empty or
//     smaller than byte_size, MEMORY_KIND_CUDA_IPC on a host-mode daemon);
//   * TensorRef: RegionTable::View's rules (unknown dtype, shape different
//     from the local shape, strides not matching shape, innermost stride
//     != 1, overflowing extents, a region not declared, a view that runs
//     past its region);
//   * grad shape different from the param's;
//   * `cancelled()` true after mapping (the trainer went away): Cancelled.
#include <functional>
#include <map>
#include <memory>
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
  // The mapped regions every view above points into.
  RegionTable regions;

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

}  // namespace muond
