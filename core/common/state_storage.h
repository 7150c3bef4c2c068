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
// Locations: kDevice, the backend's own memory; kHost, pinned host memory
// (mapped: the device can reach it in place), so the state takes no device
// memory; a Muon group's momentum is streamed through two device slots under
// Newton–Schulz (core/step/group_step.h), AdamW moments are read and written
// in place. On the CPU backend both are host memory.
#include <cstdint>
#include <string_view>

#include "core/common/dtype.h"

namespace muond {

enum class StateLocation : int32_t { kDevice = 0, kHost = 1 };

constexpr std::string_view StateLocationName(StateLocation location) {
  return location == StateLocation::kHost ? "host" : "device";
}

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

}  // namespace muond
