#include "core/muon/muon_variant.h"

#include <string>

#include "absl/strings/str_cat.h"

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

}  // namespace muond
