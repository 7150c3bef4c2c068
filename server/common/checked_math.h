#pragma once
// Overflow-checked int64 arithmetic for validating shapes, strides and byte
// ranges that come from the wire (a hostile or buggy client must not make
// the daemon compute a wrapped-around extent).
#include <cstdint>
#include <optional>

namespace muond {

inline std::optional<int64_t> CheckedMul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

inline std::optional<int64_t> CheckedAdd(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

}  // namespace muond
