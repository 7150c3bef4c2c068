#include "core/step/state_io.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/backend/bf16.h"
#include "core/backend/elementwise_math.h"
#include "core/common/state_storage.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

int64_t BlocksOf(int64_t elements) {
  return (elements + kStateBlock - 1) / kStateBlock;
}

float Dequantize(uint8_t code, float scale, Fp8Coding coding) {
  return coding == Fp8Coding::kSquareRoot
             ? ew::DequantizeSecondMoment(code, scale)
             : ew::DequantizeE4M3(code, scale);
}

// Whether every value of a block is exactly its codes dequantized with
// `scale` (bitwise: a -0 stays -0).
bool Reproduces(absl::Span<const float> values, const uint8_t* codes,
                float scale, Fp8Coding coding) {
  for (size_t k = 0; k < values.size(); ++k) {
    if (FloatBits(Dequantize(codes[k], scale, coding)) !=
        FloatBits(values[k])) {
      return false;
    }
  }
  return true;
}

void QuantizeWith(absl::Span<const float> values, float scale, uint8_t* codes,
                  Fp8Coding coding) {
  for (size_t k = 0; k < values.size(); ++k) {
    codes[k] = coding == Fp8Coding::kSquareRoot
                   ? ew::QuantizeSecondMomentRoot(values[k], scale)
                   : ew::QuantizeE4M3(values[k], scale);
  }
}

// One block by the step's rule; when the values are exactly some scale's
// codes, that scale: an exported block's absmax is 448 * s rounded, and
// absmax / 448 rounded is s or an ulp or two beside it. For kSquareRoot the
// codes hold the values' square roots (the step's ew::SecondMomentRoot).
float QuantizeBlock(absl::Span<const float> values, uint8_t* codes,
                    Fp8Coding coding) {
  std::vector<float> coded(values.begin(), values.end());
  if (coding == Fp8Coding::kSquareRoot) {
    for (float& v : coded) v = ew::SecondMomentRoot(v);
  }
  float absmax = 0.0f;
  for (float v : coded) absmax = ew::AbsMaxStep(absmax, v);
  const float scale = ew::BlockScale(absmax);
  QuantizeWith(coded, scale, codes, coding);
  if (!(scale > 0.0f) || std::isinf(scale) ||
      Reproduces(values, codes, scale, coding)) {
    return scale;
  }
  std::vector<uint8_t> trial(values.size());
  for (float toward : {0.0f, std::numeric_limits<float>::infinity()}) {
    float candidate = scale;
    for (int ulps = 1; ulps <= 2; ++ulps) {
      candidate = std::nextafter(candidate, toward);
      QuantizeWith(coded, candidate, trial.data(), coding);
      if (Reproduces(values, trial.data(), candidate, coding)) {
        std::copy(trial.begin(), trial.end(), codes);
        return candidate;
      }
    }
  }
  return scale;
}

// fp8 state on the host: codes and scales copied, dequantized.
absl::StatusOr<std::vector<float>> Fp8ToHost(Backend& backend,
                                             const MatrixView& v,
                                             const float* scales,
                                             Fp8Coding coding) {
  std::vector<uint8_t> codes(v.numel());
  std::vector<float> host_scales(BlocksOf(v.numel()));
  RETURN_IF_ERROR(backend.CopyToHost(codes.data(), v.data, v.numel()));
  RETURN_IF_ERROR(backend.CopyToHost(host_scales.data(), scales,
                                     int64_t(host_scales.size()) * 4));
  return DequantizeStateBlocks(codes, host_scales, coding);
}

// A contiguous state buffer as fp32 on the host; bf16 state widens exactly,
// fp8 dequantizes exactly.
absl::StatusOr<std::vector<float>> TensorToHost(Backend& backend,
                                                const MatrixView& v,
                                                const float* scales,
                                                Fp8Coding coding) {
  if (v.dtype == DType::kFloat8E4M3) {
    return Fp8ToHost(backend, v, scales, coding);
  }
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

// bf16 state holds what rounds to a finite bf16: a finite fp32 value of
// |x| >= kBf16OverflowThreshold would become +-inf, and the next step would
// make the params non-finite. (fp8 state scales each block: it saturates.)
absl::Status CheckFitsBf16(const std::string& key,
                           const std::vector<float>& values) {
  const float limit = BitsToFloat(kBf16OverflowThresholdBits);
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isfinite(values[i]) && !(std::fabs(values[i]) < limit)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state entry '", key, "' element ", i, " (", values[i],
          ") overflows the group's bf16 state (|value| must be below ", limit,
          "); nothing was loaded"));
    }
  }
  return absl::OkStatus();
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
  if (entry.tensor.dtype == DType::kBFloat16) {
    return CheckFitsBf16(entry.key, it->second);
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

// Writes state tensors from fp32 host values in their dtype. CopyFromHost
// may read the source until the next Synchronize, so the converted images
// live as long as this.
class StateUploads {
 public:
  absl::Status Upload(const StateEntry& e, const std::vector<float>& values) {
    switch (e.tensor.dtype) {
      case DType::kFloat32:
        return e.backend->CopyFromHost(e.tensor.data, values.data(),
                                       int64_t(values.size()) * 4);
      case DType::kFloat8E4M3:
        return UploadFp8(e, values);
      default:
        return UploadBf16(e, values);
    }
  }

 private:
  absl::Status UploadFp8(const StateEntry& e,
                         const std::vector<float>& values) {
    std::vector<uint8_t>& codes = fp8_codes_.emplace_back(values.size());
    std::vector<float>& scales =
        fp8_scales_.emplace_back(BlocksOf(int64_t(values.size())));
    QuantizeStateBlocks(values, codes.data(), scales.data(), e.coding);
    RETURN_IF_ERROR(
        e.backend->CopyFromHost(e.tensor.data, codes.data(), codes.size()));
    return e.backend->CopyFromHost(e.scales, scales.data(), scales.size() * 4);
  }
  absl::Status UploadBf16(const StateEntry& e,
                          const std::vector<float>& values) {
    std::vector<uint16_t>& image = bf16_images_.emplace_back(values.size());
    for (size_t i = 0; i < image.size(); ++i) {
      image[i] = FloatToBf16Bits(values[i]);
    }
    return e.backend->CopyFromHost(e.tensor.data, image.data(),
                                   image.size() * 2);
  }

  std::vector<std::vector<uint16_t>> bf16_images_;
  std::vector<std::vector<uint8_t>> fp8_codes_;
  std::vector<std::vector<float>> fp8_scales_;
};

}  // namespace

void QuantizeStateBlocks(absl::Span<const float> values, uint8_t* codes,
                         float* scales, Fp8Coding coding) {
  for (size_t b0 = 0, b = 0; b0 < values.size(); b0 += kStateBlock, ++b) {
    const size_t len = std::min<size_t>(kStateBlock, values.size() - b0);
    scales[b] = QuantizeBlock(values.subspan(b0, len), codes + b0, coding);
  }
}

std::vector<float> DequantizeStateBlocks(absl::Span<const uint8_t> codes,
                                         absl::Span<const float> scales,
                                         Fp8Coding coding) {
  std::vector<float> values(codes.size());
  for (size_t e = 0; e < codes.size(); ++e) {
    values[e] = Dequantize(codes[e], scales[e / kStateBlock], coding);
  }
  return values;
}

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
      ASSIGN_OR_RETURN(out[e.key],
                       TensorToHost(*e.backend, e.tensor, e.scales, e.coding));
    }
  }
  return out;
}

absl::Status CheckStateEntries(const StateMap& state,
                               absl::Span<const StateEntry> entries) {
  for (const StateEntry& e : entries) RETURN_IF_ERROR(CheckEntry(state, e));
  return CheckNoUnknownKeys(state, entries);
}

absl::Status ImportStateEntries(
    const StateMap& state, absl::Span<const StateEntry> entries,
    absl::Span<Backend* const> backends,
    const std::function<void(size_t, int64_t)>& set_count) {
  RETURN_IF_ERROR(CheckStateEntries(state, entries));
  StateUploads uploads;
  for (const StateEntry& e : entries) {
    if (!e.is_count()) RETURN_IF_ERROR(uploads.Upload(e, state.at(e.key)));
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
