#pragma once
// A daemon's optimizer state <-> its safetensors file (DaemonCore::SaveState
// and LoadState; the file format's own rules are server/common/safetensors.h).
//
// File keys: the engine's "<group>/<param>.<suffix>" (or "<param>.<suffix>")
// is "<group>/<param>/g<g>t<t>/<suffix>" in the file, so files of different
// ranks never collide and Python tools can group them; AdamW step counts
// "<group>/<param>.step" (per param, as torch.optim keeps them) are
// "<group>/<param>/g<g>t<t>/step". A file written when counts were per group
// ("<group>/.step", no per-param count) still loads: every param of the
// group gets that count. Metadata (strings):
// format, job_id, rank, step_id, plan_version, domains and hyperparameters
// (JSON, informational).
//
// The loaded-state rules live in StateFromFile: the file is of this job, its
// step_id is an integer in [-1, max_step_id] (the daemon's step-id bound,
// server/common/step_id.h kMaxStepId), it has exactly the tensors this rank's
// registration owns with their shapes, every value is finite, exp_avg_sq is
// >= 0, and AdamW step counts are integers in [0, 2^62). Both directions are
// linear in the number of state entries (one hash lookup per entry).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/common/safetensors.h"
#include "server/daemon/registration.h"

namespace muond {

using StateTensors = std::map<std::string, std::vector<float>>;

// AdamW step counts stay below this (no overflow on +1).
inline constexpr int64_t kMaxAdamWStepCount = int64_t{1} << 62;

struct StateFileInfo {
  std::string job_id;
  int rank = 0;
  int64_t step_id = -1;  // -1: no step yet
  int64_t plan_version = 0;
};

// The file of `state` (the engine's ExportState), consumed.
SafetensorsFile StateToFile(const Registration& reg, StateTensors state,
                            const StateFileInfo& info);

struct LoadedState {
  StateTensors state;    // engine names, as ImportState takes them
  int64_t step_id = -1;  // the file's
};

// The value rules of one state entry, the one home for files and
// ImportState: every value finite, exp_avg_sq >= 0, AdamW step counts
// integers in [0, 2^62). `name` is the engine's entry name (it tells the
// kind); InvalidArgument "<where>: tensor '<key>' ..." naming the index.
absl::Status CheckStateValues(const std::string& where, const std::string& name,
                              const std::string& key,
                              const std::vector<float>& values);

// Checks `file` (read from `path`) against the engine's current state
// `current` (names and sizes) and the registration; InvalidArgument naming
// the path, the tensor or field and the rule. Consumes `file`.
absl::StatusOr<LoadedState> StateFromFile(const std::string& path,
                                          SafetensorsFile file,
                                          const Registration& reg,
                                          const StateTensors& current,
                                          const std::string& job_id,
                                          int64_t max_step_id);

}  // namespace muond
