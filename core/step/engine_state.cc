// The engine's optimizer state as named entries, for ExportState and
// ImportState (the codec: state_io.h).
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/step/layer_sharded_muon_impl.h"

namespace muond {

std::vector<StateStorageBytes> LayerShardedMuonImpl::state_bytes_by_storage()
    const {
  std::map<std::pair<StateLocation, DType>, int64_t> bytes;
  for (const GroupState& group : groups_) {
    const bool muon = group.config.algorithm == Algorithm::kMuon;
    const StateLocation location = muon ? group.config.muon.state_location
                                        : group.config.adamw.state_location;
    const DType dtype =
        muon ? group.config.muon.state_dtype : group.config.adamw.state_dtype;
    bytes[{location, dtype}] += group.state_bytes - group.variant_state_bytes;
    // The variants' second moments live in the backend's own memory
    // whatever the group's location (variant_phase.cc).
    bytes[{StateLocation::kDevice, DType::kFloat32}] +=
        group.variant_state_bytes;
  }
  std::vector<StateStorageBytes> out;
  for (const auto& [storage, n] : bytes) {
    if (n > 0) out.push_back({storage.first, storage.second, n});
  }
  return out;
}

std::vector<StateEntry> LayerShardedMuonImpl::StateEntries() const {
  std::vector<StateEntry> entries;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const GroupState& group = groups_[gi];
    const std::string& gname = group.config.name;
    const bool muon = group.config.algorithm == Algorithm::kMuon;
    for (size_t pi = 0; pi < group.params.size(); ++pi) {
      const ParamState& p = group.params[pi];
      const std::string base = gname + "/" + p.spec.name;
      auto tensor = [&](const std::string& suffix, const MatrixView& view,
                        float* scales = nullptr,
                        Fp8Coding coding = Fp8Coding::kLinear) {
        StateEntry e;
        e.key = base + suffix;
        e.backend = group.backend;
        e.tensor = view;
        e.scales = scales;
        e.coding = coding;
        entries.push_back(std::move(e));
      };
      if (muon) {
        tensor(".momentum", p.momentum, p.momentum_scales);
        // The variants' second moment (torch's "variance_neuron" /
        // "moment2_buffer": muon_variant.h).
        switch (group.config.muon.variant) {
          case MuonVariant::kNorMuon:
            tensor(".variance_neuron", p.moment2);
            break;
          case MuonVariant::kAdaMuon:
            tensor(".moment2", p.moment2);
            break;
          case MuonVariant::kMuon:
            break;
        }
        continue;
      }
      tensor(".exp_avg", p.exp_avg, p.moment_scales.exp_avg);
      tensor(".exp_avg_sq", p.exp_avg_sq, p.moment_scales.exp_avg_sq,
             Fp8Coding::kSquareRoot);
      StateEntry count;
      count.key = base + ".step";
      count.count = p.adamw_step;
      count.group = gname;
      count.param = p.spec.name;
      count.group_index = int(gi);
      count.param_index = int(pi);
      entries.push_back(std::move(count));
    }
  }
  return entries;
}

absl::StatusOr<std::map<std::string, std::vector<float>>>
LayerShardedMuonImpl::ExportState() const {
  return ExportStateEntries(StateEntries());
}

absl::Status LayerShardedMuonImpl::CheckImportState(
    const std::map<std::string, std::vector<float>>& state) const {
  const std::vector<StateEntry> entries = StateEntries();
  return CheckStateEntries(WithPerParamStepCounts(state, entries), entries);
}

absl::Status LayerShardedMuonImpl::ImportState(
    const std::map<std::string, std::vector<float>>& state) {
  const std::vector<StateEntry> entries = StateEntries();
  std::vector<Backend*> lane_backends;
  for (const Lane& lane : lanes_) lane_backends.push_back(lane.backend);
  // Count entries are the AdamW params' step counts, "<group>/<param>.step".
  return ImportStateEntries(WithPerParamStepCounts(state, entries), entries,
                            lane_backends, [&](size_t i, int64_t count) {
                              groups_[entries[i].group_index]
                                  .params[entries[i].param_index]
                                  .adamw_step = count;
                            });
}

}  // namespace muond
