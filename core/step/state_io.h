#pragma once
// Save/load of the engine's optimizer state as named fp32 host vectors
// (LayerShardedMuon::ExportState / ImportState).
//
// bf16 state exports widened exactly and imports rounded to nearest even;
// fp8_e4m3 state exports dequantized exactly (code * block scale) and imports
// quantized per block of kStateBlock by the step's rule (elementwise_math.h),
// except that a block which is exactly some scale's codes (an exported fp8
// block) gets that scale back: either way an exported state imports back bit
// for bit. AdamW's fp8 exp_avg_sq holds its square root q
// (ew::SecondMomentRoot): it exports v = q * q in fp32 and imports sqrt(v)
// quantized per block; sqrt(fl(q * q)) == q in fp32 unless q * q underflows
// (q below ~1e-19), so an exported state imports back bit for bit there too.
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

// What an fp8_e4m3 state tensor's codes hold: the value itself, or (AdamW's
// exp_avg_sq) its square root.
enum class Fp8Coding { kLinear, kSquareRoot };

// One named piece of state: a contiguous fp32, bf16 or fp8_e4m3 tensor in
// `backend` memory (fp8: with its block scales), or (backend null) a step
// count that travels as one fp32 value.
struct StateEntry {
  std::string key;
  Backend* backend = nullptr;
  MatrixView tensor;
  float* scales = nullptr;  // fp8_e4m3: one per kStateBlock elements
  Fp8Coding coding = Fp8Coding::kLinear;  // fp8_e4m3: what the codes hold
  int64_t count = 0;
  // A count's AdamW group and param, for the old group key and the error.
  std::string group;
  std::string param;
  int group_index = 0;  // where the engine keeps the count
  int param_index = 0;

  bool is_count() const { return backend == nullptr; }
};

using StateMap = std::map<std::string, std::vector<float>>;

// `values` (fp32) as fp8 e4m3 codes and per-block scales (kStateBlock
// elements a block, the last may be short) in `coding`: the import rule
// above. codes has values.size() entries, scales one per block.
void QuantizeStateBlocks(absl::Span<const float> values, uint8_t* codes,
                         float* scales, Fp8Coding coding = Fp8Coding::kLinear);
// codes and their block scales -> fp32 values (exact: code * scale, squared
// for kSquareRoot).
std::vector<float> DequantizeStateBlocks(absl::Span<const uint8_t> codes,
                                         absl::Span<const float> scales,
                                         Fp8Coding coding = Fp8Coding::kLinear);

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

// Checks that `state` has exactly the keys of `entries` with their sizes,
// and that bf16 entries' values round to a finite bf16 (InvalidArgument
// naming the first entry that breaks a rule, in entry order).
absl::Status CheckStateEntries(const StateMap& state,
                               absl::Span<const StateEntry> entries);

// CheckStateEntries (before anything is written), then writes every tensor,
// hands each count entry's value to `set_count(entry index, value)`, and
// synchronises `backends` (the uploads read host memory until then).
absl::Status ImportStateEntries(
    const StateMap& state, absl::Span<const StateEntry> entries,
    absl::Span<Backend* const> backends,
    const std::function<void(size_t, int64_t)>& set_count);

}  // namespace muond
