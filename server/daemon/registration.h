#pragma once
// Validating a RegisterParamsRequest and binding it to trainer memory.
//
// BuildRegistration opens every distinct handle once (shm objects by name,
// CUDA IPC handles by handle bytes), checks every TensorRef against the
// mapping it lives in and the sharding model, and returns views into the
// mappings. On any error nothing stays mapped and the message names the
// group/param/field and the rule:
//   * job_id differs from the daemon's; no groups; empty or duplicate group
//     names; duplicate param names (across groups); unknown algorithm;
//   * domain: sizes < 1, (g, t) outside it, G*T > world size, the same domain
//     name with different sizes or coordinates in two groups;
//   * full_shape not 1-D/2-D or a dim < 1; Muon params not 2-D; local shape
//     not following from full_shape, tags and domain (core/plan MakeShardSpec);
//   * TensorRef: unknown kind or dtype, shape different from the local shape,
//     strides not matching shape, innermost stride != 1, negative strides,
//     overflowing extents, a view that runs past its mapping, an shm object
//     missing, empty or too small, CUDA_IPC on a host-mode daemon;
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
  // Opened handles by key ("shm:<name>" or "ipc:<handle bytes>").
  std::map<std::string, std::unique_ptr<MappedRegion>> mappings;

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
