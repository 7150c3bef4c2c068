#pragma once
// Save/load of the engine's optimizer state as named fp32 host vectors
// (LayerShardedMuon::ExportState / ImportState).
//
// bf16 state exports widened exactly and imports rounded to nearest even, so
// an exported bf16 state imports back bit for bit.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/common/matrix_view.h"

namespace muond {

// One named piece of state: a contiguous fp32 or bf16 tensor in `backend`
// memory, or (backend null) a step count that travels as one fp32 value.
struct StateEntry {
  std::string key;
  Backend* backend = nullptr;
  MatrixView tensor;
  int64_t count = 0;
  // A count's AdamW group and param, for the old group key and the error.
  std::string group;
  std::string param;
  int group_index = 0;  // where the engine keeps the count
  int param_index = 0;

  bool is_count() const { return backend == nullptr; }
};

using StateMap = std::map<std::string, std::vector<float>>;

// Copies every entry to the host.
absl::StatusOr<StateMap> ExportStateEntries(
    absl::Span<const StateEntry> entries);

// `state` with each AdamW group's old step count "<group>/.step" (one count
// per group, before counts were per param; old state files keep loading)
// replaced by the per-param counts of `entries` ("<group>/<param>.step")
// when it has none of them: every param of the group gets the group's
// count. A map with both keeps both (ImportStateEntries then refuses the old
// key as unknown).
StateMap WithPerParamStepCounts(StateMap state,
                                absl::Span<const StateEntry> entries);

// Checks that `state` has exactly the keys of `entries` with their sizes
// (InvalidArgument naming the first entry that breaks the rule, in entry
// order, before anything is written), then writes every tensor, hands each
// count entry's value to `set_count(entry index, value)`, and synchronises
// `backends` (the uploads read host memory until then).
absl::Status ImportStateEntries(
    const StateMap& state, absl::Span<const StateEntry> entries,
    absl::Span<Backend* const> backends,
    const std::function<void(size_t, int64_t)>& set_count);

}  // namespace muond
