#include "core/step/domain_agreement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace muond {
namespace {

constexpr int64_t kLow = int64_t(1) << 24;

}  // namespace

std::array<float, kDomainVoteFloats> EncodeDomainVote(const DomainVote& vote) {
  return {vote.all_finite ? 1.0f : 0.0f, float(vote.homes_version / kLow),
          float(vote.homes_version % kLow), float(vote.oldest_held / kLow),
          float(vote.oldest_held % kLow)};
}

DomainVote DecodeDomainVote(absl::Span<const float> f) {
  return {.all_finite = f[0] == 1.0f,
          .homes_version = int64_t(f[1]) * kLow + int64_t(f[2]),
          .oldest_held = int64_t(f[3]) * kLow + int64_t(f[4])};
}

DomainVote FoldDomainVotes(DomainVote agreed,
                           absl::Span<const float> gathered) {
  for (size_t at = 0; at + kDomainVoteFloats <= gathered.size();
       at += kDomainVoteFloats) {
    const DomainVote rank =
        DecodeDomainVote(gathered.subspan(at, kDomainVoteFloats));
    agreed.all_finite = agreed.all_finite && rank.all_finite;
    agreed.homes_version = std::min(agreed.homes_version, rank.homes_version);
    agreed.oldest_held = std::max(agreed.oldest_held, rank.oldest_held);
  }
  return agreed;
}

absl::Status CheckHomesVersionHeld(const DomainVote& agreed,
                                   const std::string& group, size_t history) {
  if (agreed.homes_version == 0 || agreed.homes_version >= agreed.oldest_held) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "group '", group,
      "': the domain's ranks hold no NS homes version in common (a "
      "rank's newest is version ",
      agreed.homes_version, ", another rank holds only versions from ",
      agreed.oldest_held, " on; each keeps its newest ", history,
      ": more plan versions reached it between two steps); the step "
      "was not applied on any rank, retry it"));
}

}  // namespace muond
