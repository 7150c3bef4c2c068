#include "core/step/state_io.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/backend/bf16.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

// A contiguous state buffer as fp32 on the host; bf16 state widens exactly.
absl::StatusOr<std::vector<float>> TensorToHost(Backend& backend,
                                                const MatrixView& v) {
  std::vector<float> host(v.numel());
  if (v.dtype == DType::kFloat32) {
    RETURN_IF_ERROR(backend.CopyToHost(host.data(), v.data, v.numel() * 4));
    return host;
  }
  std::vector<uint16_t> bits(v.numel());
  RETURN_IF_ERROR(backend.CopyToHost(bits.data(), v.data, v.numel() * 2));
  for (size_t i = 0; i < bits.size(); ++i) host[i] = Bf16BitsToFloat(bits[i]);
  return host;
}

absl::Status CheckEntry(const StateMap& state, const StateEntry& entry) {
  auto it = state.find(entry.key);
  if (entry.is_count()) {
    if (it == state.end() || it->second.size() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("state has no step count '", entry.key,
                       "' (one value) for AdamW param '", entry.param,
                       "' of group '", entry.group, "'"));
    }
    return absl::OkStatus();
  }
  if (it == state.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has no entry for '", entry.key, "'"));
  }
  if (int64_t(it->second.size()) != entry.tensor.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state entry '", entry.key, "' has ", it->second.size(),
        " fp32 elements; the param's shard needs ", entry.tensor.numel()));
  }
  return absl::OkStatus();
}

absl::Status CheckNoUnknownKeys(const StateMap& state,
                                absl::Span<const StateEntry> entries) {
  if (state.size() == entries.size()) return absl::OkStatus();
  std::set<std::string> known;
  for (const StateEntry& e : entries) known.insert(e.key);
  for (const auto& [key, _] : state) {
    if (!known.contains(key)) {
      return absl::InvalidArgumentError(
          absl::StrCat("state entry '", key, "' matches no registered param"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

StateMap WithPerParamStepCounts(StateMap state,
                                absl::Span<const StateEntry> entries) {
  // "<group>/.step" -> the count entries of that group's params.
  std::map<std::string, std::vector<const StateEntry*>> by_group_key;
  for (const StateEntry& e : entries) {
    if (!e.is_count()) continue;
    by_group_key[e.group + "/.step"].push_back(&e);
  }
  for (const auto& [group_key, counts] : by_group_key) {
    auto old = state.find(group_key);
    if (old == state.end()) continue;
    const bool any_new = std::any_of(
        counts.begin(), counts.end(),
        [&](const StateEntry* e) { return state.contains(e->key); });
    if (any_new) continue;
    const std::vector<float> value = old->second;
    state.erase(old);
    for (const StateEntry* e : counts) state[e->key] = value;
  }
  return state;
}

absl::StatusOr<StateMap> ExportStateEntries(
    absl::Span<const StateEntry> entries) {
  StateMap out;
  for (const StateEntry& e : entries) {
    if (e.is_count()) {
      out[e.key] = {float(e.count)};
    } else {
      ASSIGN_OR_RETURN(out[e.key], TensorToHost(*e.backend, e.tensor));
    }
  }
  return out;
}

absl::Status ImportStateEntries(
    const StateMap& state, absl::Span<const StateEntry> entries,
    absl::Span<Backend* const> backends,
    const std::function<void(size_t, int64_t)>& set_count) {
  for (const StateEntry& e : entries) RETURN_IF_ERROR(CheckEntry(state, e));
  RETURN_IF_ERROR(CheckNoUnknownKeys(state, entries));
  // CopyFromHost may read the source until the next Synchronize, so the
  // bf16 images live until the backends have synchronized below.
  std::vector<std::vector<uint16_t>> bf16_images;
  for (const StateEntry& e : entries) {
    if (e.is_count()) continue;
    const std::vector<float>& values = state.at(e.key);
    if (e.tensor.dtype == DType::kFloat32) {
      RETURN_IF_ERROR(e.backend->CopyFromHost(e.tensor.data, values.data(),
                                              values.size() * 4));
      continue;
    }
    std::vector<uint16_t>& image = bf16_images.emplace_back(values.size());
    for (size_t i = 0; i < image.size(); ++i) {
      image[i] = FloatToBf16Bits(values[i]);
    }
    RETURN_IF_ERROR(
        e.backend->CopyFromHost(e.tensor.data, image.data(), image.size() * 2));
  }
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].is_count()) {
      set_count(i, int64_t(state.at(entries[i].key)[0]));
    }
  }
  for (Backend* backend : backends) RETURN_IF_ERROR(backend->Synchronize());
  return absl::OkStatus();
}

}  // namespace muond
