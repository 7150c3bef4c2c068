#include "core/step/finite_grads.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "core/backend/bf16.h"
#include "core/common/status_macros.h"

namespace muond {

float GradLimit(const GroupState& group) {
  const bool bf16 = group.config.algorithm == Algorithm::kMuon &&
                    (group.ns_dtype == DType::kBFloat16 ||
                     group.config.muon.state_dtype == DType::kBFloat16);
  return bf16 ? BitsToFloat(kBf16OverflowThresholdBits)
              : std::numeric_limits<float>::infinity();
}

std::vector<MatrixView> GradsToCheck(const GroupState& group,
                                     const std::set<std::string>& skip) {
  std::vector<MatrixView> grads;
  for (const ParamBinding& b : group.config.params) {
    if (!skip.contains(b.name)) grads.push_back(b.grad);
  }
  return grads;
}

absl::StatusOr<bool> GradsWithinLimit(const GroupState& group,
                                      const std::set<std::string>& skip) {
  const std::vector<MatrixView> grads = GradsToCheck(group, skip);
  if (grads.empty()) return true;
  return group.backend->AllFiniteBelow(grads, GradLimit(group));
}

absl::StatusOr<std::vector<std::string>> BadGradNames(
    const GroupState& group, const std::set<std::string>& skip) {
  const float limit = GradLimit(group);
  std::vector<std::string> names;
  for (const ParamBinding& b : group.config.params) {
    if (skip.contains(b.name)) continue;
    ASSIGN_OR_RETURN(bool ok, group.backend->AllFiniteBelow({b.grad}, limit));
    if (ok) continue;
    std::string name = group.config.name + "/" + b.name;
    ASSIGN_OR_RETURN(bool finite, group.backend->AllFinite({b.grad}));
    if (finite) {
      absl::StrAppend(
          &name,
          " (finite in fp32 but beyond the bf16 range, |g| >= 3.396e38, "
          "which ",
          group.ns_dtype == DType::kBFloat16
              ? "fp32_matmul_prec \"medium\" (bf16 Newton-Schulz input)"
              : "the bf16 momentum state",
          " cannot hold)");
    }
    names.push_back(std::move(name));
  }
  return names;
}

}  // namespace muond
