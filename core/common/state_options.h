#pragma once
// The optimizer-state options as the daemon takes them from the wire
// (MuonOptions / AdamWOptions state_dtype and state_location): their names,
// the dtype of an auto group, and the bytes reported by location and dtype.
// Apart from state_storage.h, which the CUDA kernels include (no absl, no
// C++20 there).
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/common/dtype.h"
#include "core/common/state_storage.h"

namespace muond {

// Bytes of optimizer state in one location and dtype (what GetStatus and
// the metrics report).
struct StateStorageBytes {
  StateLocation location = StateLocation::kDevice;
  DType dtype = DType::kFloat32;
  int64_t bytes = 0;
  bool operator==(const StateStorageBytes&) const = default;
};

// The state dtype of a group whose state_dtype is auto (the wire's
// STATE_DTYPE_UNSPECIFIED), torch's rule: torch.optim.Muon's momentum_buffer
// is zeros_like(grad) and AdamW's moments zeros_like(param), so a group whose
// params are all bf16 keeps bf16 state; any other group (fp32, fp16, mixed,
// none) fp32.
constexpr DType AutoStateDType(std::span<const DType> param_dtypes) {
  if (param_dtypes.empty()) return DType::kFloat32;
  for (DType d : param_dtypes) {
    if (d != DType::kBFloat16) return DType::kFloat32;
  }
  return DType::kBFloat16;
}

// "fp32", "bf16" or "fp8_e4m3" (DTypeName) -> the state dtype;
// InvalidArgument naming state_dtype and the names otherwise.
inline absl::StatusOr<DType> ParseStateDType(std::string_view name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3}) {
    if (DTypeName(d) == name) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "state_dtype '", std::string(name), "' is not fp32, bf16 or fp8_e4m3"));
}

// "device" or "host" (StateLocationName) -> the location.
inline absl::StatusOr<StateLocation> ParseStateLocation(std::string_view name) {
  for (StateLocation l : {StateLocation::kDevice, StateLocation::kHost}) {
    if (StateLocationName(l) == name) return l;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "state_location '", std::string(name), "' is not device or host"));
}

}  // namespace muond
