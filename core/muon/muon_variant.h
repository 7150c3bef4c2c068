#pragma once
// The Muon variants that renormalise the Newton–Schulz output O with a second
// moment before the update (MuonOptions::variant), after the anchors:
//
//   kNorMuon  per output row i (dion normuon.py, _normuon_normalization_core):
//               v_i <- lerp(v_i, mean_j(O_ij^2), 1 - beta2)
//               O_ij <- O_ij / (sqrt(v_i) + eps)
//             then O is rescaled to its Frobenius norm before the division:
//               O <- O * ||O_before||_F / max(||O||_F, eps)
//             (eps = MuonOptions::moment2_eps; dion uses 1e-8 for both, the
//             default here; the max keeps a zero gradient's update at zero
//             instead of 0/0).
//   kAdaMuon  elementwise (Emerging-Optimizers adaptive_muon.py,
//             moment2_method "adamuon"): v <- lerp(v, O*O, 1 - beta2);
//             O <- O / (sqrt(v) + eps); no rescale.
//
// Both act on the unscaled NS output; the Muon scale (MuonAdjustedLr) applies
// after them, as in the anchors. The state v is fp32: NorMuon's one value per
// row of the full matrix (torch key "variance_neuron", shape (P, 1)), AdaMuon's
// the matrix's shape ("moment2_buffer").
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace muond {

enum class MuonVariant : int32_t { kMuon = 0, kNorMuon = 1, kAdaMuon = 2 };

// "muon", "normuon", "adamuon".
std::string_view MuonVariantName(MuonVariant variant);
// InvalidArgument "variant: unknown name '<name>'; expected muon, normuon or
// adamuon" otherwise.
absl::StatusOr<MuonVariant> ParseMuonVariant(std::string_view name);

// NorMuon's row math on the host for a whole matrix of `cols` columns:
// row_sumsq[i] = sum_j O_ij^2 (Backend::RowSumSquares), v_old the state.
// Writes v_new[i] = lerp(v_old[i], row_sumsq[i] / cols, 1 - beta2) (fp32, as
// torch's lerp) and factors[i], the one fp32 multiplier of row i that
// divides by sqrt(v_new[i]) + eps and rescales to the Frobenius norm:
//   d_i = sqrt(v_new[i]) + eps, N1 = sum_i row_sumsq[i],
//   N2 = sum_i row_sumsq[i] / d_i^2, factors[i] = sqrt(N1) /
//   max(sqrt(N2), eps) / d_i,
// in double, the sums taken in row order (so every layout that hands the
// same rows gets the same bits), rounded once. All spans have one entry per
// row. InvalidArgument on mismatched lengths or cols < 1.
absl::Status NorMuonRowFactors(absl::Span<const float> row_sumsq,
                               absl::Span<const float> v_old, int64_t cols,
                               double beta2, double eps,
                               absl::Span<float> v_new,
                               absl::Span<float> factors);

}  // namespace muond
