#pragma once
// Element types muond moves and computes on. Trainer memory is fp32 or bf16;
// optimizer state and Newton–Schulz inputs are fp32 unless an option says
// otherwise. fp16 is internal only: the iteration dtype of Gram
// Newton–Schulz (core/muon/gram_newton_schulz.h); it never crosses the wire.
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace muond {

enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

// Size of one element in bytes.
constexpr size_t DTypeSize(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

constexpr std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
    default:
      return "fp32";
  }
}

}  // namespace muond
