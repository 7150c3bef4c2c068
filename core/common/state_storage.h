#pragma once
// Where and in what precision a group's optimizer state lives (Muon momentum,
// AdamW moments; MuonOptions / AdamWOptions state_dtype and state_location).
//
// Dtypes: fp32; bf16 (torch keeps a bf16 momentum for bf16 params);
// fp8_e4m3, blockwise scaled as torchao's fp8 optimizers: every block of
// kStateBlock consecutive elements of a shard's contiguous state holds fp8
// e4m3 codes and one fp32 scale (the block's absmax / 448), so the state
// takes 1 + 4/kStateBlock bytes per element.
//
// Locations: kDevice, the backend's own memory; kHost, pinned host memory the
// device reads and writes in place (mapped), so the state takes no device
// memory. On the CPU backend both are host memory.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/common/dtype.h"

namespace muond {

enum class StateLocation : int32_t { kDevice = 0, kHost = 1 };

constexpr std::string_view StateLocationName(StateLocation location) {
  return location == StateLocation::kHost ? "host" : "device";
}

// Bytes of optimizer state in one location and dtype (what GetStatus and
// the metrics report).
struct StateStorageBytes {
  StateLocation location = StateLocation::kDevice;
  DType dtype = DType::kFloat32;
  int64_t bytes = 0;
  bool operator==(const StateStorageBytes&) const = default;
};

// Elements per fp32 scale of fp8 state.
inline constexpr int64_t kStateBlock = 256;

// Whether `dtype` may hold optimizer state: fp32, bf16 or fp8_e4m3.
constexpr bool IsStateDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat8E4M3;
}

// Bytes of `elements` elements of state in `dtype`, scales included.
constexpr int64_t StateBytes(DType dtype, int64_t elements) {
  if (dtype != DType::kFloat8E4M3) {
    return elements * static_cast<int64_t>(DTypeSize(dtype));
  }
  return elements + 4 * ((elements + kStateBlock - 1) / kStateBlock);
}

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
