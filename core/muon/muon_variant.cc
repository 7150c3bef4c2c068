#include "core/muon/muon_variant.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/backend/elementwise_math.h"

namespace muond {

std::string_view MuonVariantName(MuonVariant variant) {
  switch (variant) {
    case MuonVariant::kMuon:
      return "muon";
    case MuonVariant::kNorMuon:
      return "normuon";
    case MuonVariant::kAdaMuon:
      return "adamuon";
  }
  return "unknown";
}

absl::StatusOr<MuonVariant> ParseMuonVariant(std::string_view name) {
  for (MuonVariant v :
       {MuonVariant::kMuon, MuonVariant::kNorMuon, MuonVariant::kAdaMuon}) {
    if (MuonVariantName(v) == name) return v;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("variant: unknown name '", std::string(name).substr(0, 64),
                   "'; expected muon, normuon or adamuon"));
}

absl::Status NorMuonRowFactors(absl::Span<const float> row_sumsq,
                               absl::Span<const float> v_old, int64_t cols,
                               double beta2, double eps,
                               absl::Span<float> v_new,
                               absl::Span<float> factors) {
  const size_t rows = row_sumsq.size();
  if (v_old.size() != rows || v_new.size() != rows || factors.size() != rows ||
      cols < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("normuon: row statistics of ", rows,
                     " rows need as many state and "
                     "factor entries and cols >= 1, got ",
                     v_old.size(), ", ", v_new.size(), ", ", factors.size(),
                     " and cols ", cols));
  }
  const float weight = static_cast<float>(1.0 - beta2);
  double n1 = 0.0, n2 = 0.0;
  for (size_t i = 0; i < rows; ++i) {
    const float mean = static_cast<float>(double(row_sumsq[i]) / double(cols));
    v_new[i] = ew::Lerp(v_old[i], mean, weight);
    const double d = std::sqrt(double(v_new[i])) + eps;
    n1 += row_sumsq[i];
    n2 += double(row_sumsq[i]) / (d * d);
  }
  const double ratio = std::sqrt(n1) / std::max(std::sqrt(n2), eps);
  for (size_t i = 0; i < rows; ++i) {
    const double d = std::sqrt(double(v_new[i])) + eps;
    factors[i] = static_cast<float>(ratio / d);
  }
  return absl::OkStatus();
}

}  // namespace muond
