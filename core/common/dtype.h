#pragma once
// Element types muond moves and computes on. Trainer memory is fp32 or bf16;
// optimizer state and Newton–Schulz inputs are fp32 unless an option says
// otherwise.
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace muond {

enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
};

// Size of one element in bytes.
constexpr size_t DTypeSize(DType dtype) {
  return dtype == DType::kBFloat16 ? 2 : 4;
}

constexpr std::string_view DTypeName(DType dtype) {
  return dtype == DType::kBFloat16 ? "bf16" : "fp32";
}

}  // namespace muond
