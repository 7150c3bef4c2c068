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
// The row formulas are core/backend/elementwise_math.h's (ew::NorMuon*); the
// backends compute them over a whole param group at once
// (Backend::NorMuonRowStats / NorMuonNormalize). Both act on the unscaled NS
// output; the Muon scale (MuonAdjustedLr) applies
// after them, as in the anchors. The state v is fp32: NorMuon's one value per
// row of the full matrix (torch key "variance_neuron", shape (P, 1)), AdaMuon's
// the matrix's shape ("moment2_buffer").
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace muond {

enum class MuonVariant : int32_t { kMuon = 0, kNorMuon = 1, kAdaMuon = 2 };

// "muon", "normuon", "adamuon".
std::string_view MuonVariantName(MuonVariant variant);
// InvalidArgument "variant: unknown name '<name>'; expected muon, normuon or
// adamuon" otherwise.
absl::StatusOr<MuonVariant> ParseMuonVariant(std::string_view name);

}  // namespace muond
