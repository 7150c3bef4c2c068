#pragma once
// Element types muond moves and computes on. Trainer memory (params, grads)
// is fp32, bf16 or fp16; optimizer state is fp32 unless an option says
// otherwise; the Newton–Schulz input is the NS work dtype (NsWorkDType: bf16
// at precision medium, the Python client's default; fp32 at highest, the
// wire's default). fp16 is also the iteration dtype of Gram Newton–Schulz
// (core/muon/gram_newton_schulz.h). fp8 e4m3 is a state dtype only: 8-bit
// optimizer state with an fp32 scale per block of kStateBlock elements
// (core/common/state_storage.h), never trainer memory or a GEMM operand.
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace muond {

enum class DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat8E4M3 = 3,
};

// Size of one element in bytes.
constexpr size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat8E4M3:
      return 1;
    default:
      return 2;
  }
}

constexpr std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat16:
      return "fp16";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
    default:
      return "fp32";
  }
}

}  // namespace muond
