#pragma once
// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status and absl::StatusOr
// (Abseil 20220623 from Debian does not ship its status macros).
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MUOND_CONCAT_INNER(a, b) a##b
#define MUOND_CONCAT(a, b) MUOND_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    const ::absl::Status _muond_st = (expr);   \
    if (!_muond_st.ok()) return _muond_st;     \
  } while (0)

#define MUOND_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  MUOND_ASSIGN_OR_RETURN_IMPL(MUOND_CONCAT(_muond_sor_, __LINE__), lhs, expr)
