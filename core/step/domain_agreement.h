#pragma once
// The per-step agreement of a group's domain, as pure functions over the
// values the ranks gather (no backend, no communicator: see
// gather_domain_votes.h for the collective that carries them).
//
// Before anything changes, every rank of a group's domain must take the same
// decision, or the ranks would wait forever in (or garble) the exchange:
//   * step or not: every rank's gradients are finite (and within the bf16
//     range where the group carries them in bf16);
//   * which NS homes to route by: the oldest of the ranks' newest homes
//     versions, so a plan that reached one rank late is taken up by the whole
//     domain one step later;
//   * whether that version is still held everywhere: each rank also brings
//     the oldest version it holds; when the agreed version is older than the
//     newest of those, some rank dropped it and every rank refuses alike.
// Each rank folds the votes of all ranks (its own included) the same way, so
// every rank reaches the same decision from the same gathered values.
#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace muond {

// What one rank brings to the agreement, or (after FoldDomainVotes) what the
// domain agreed on.
struct DomainVote {
  // Mine: my gradients pass the finite check. Agreed: every rank's do.
  bool all_finite = true;
  // Mine: the newest NS homes version I hold (0: none). Agreed: the oldest
  // of the ranks' newest, the version every rank routes by.
  int64_t homes_version = 0;
  // Mine: the oldest version I hold (0: none). Agreed: the newest of the
  // ranks' oldest; an agreed homes_version below it was dropped by a rank.
  int64_t oldest_held = 0;

  bool operator==(const DomainVote&) const = default;
};

// A vote travels as kDomainVoteFloats fp32 values, so one all_gather on the
// lane's backend memory carries it on any communicator:
// [all finite (1 or 0), homes_version / 2^24, homes_version % 2^24,
//  oldest_held / 2^24, oldest_held % 2^24]. fp32 holds integers below 2^24
// exactly, so versions below 2^48 travel exactly.
inline constexpr int kDomainVoteFloats = 5;
inline constexpr int64_t kMaxDomainVoteVersion = (int64_t(1) << 48) - 1;

std::array<float, kDomainVoteFloats> EncodeDomainVote(const DomainVote& vote);
DomainVote DecodeDomainVote(absl::Span<const float> floats);

// Folds gathered votes (kDomainVoteFloats per rank, any number of ranks)
// into `agreed`: finite only if all are, the oldest homes_version, the newest
// oldest_held. Associative and commutative, so folding the gtp group's votes
// and then the tp group's (each carrying the previous fold) covers the whole
// domain.
DomainVote FoldDomainVotes(DomainVote agreed, absl::Span<const float> gathered);

// The homes version the domain routes by. OK when `agreed.homes_version` is
// held by every rank (0, the round-robin fallback, always is); otherwise
// FailedPrecondition naming `group`, the versions and `history` (the
// versions each rank keeps): the step is refused on every rank alike, and a
// retry works once the lagging rank caught up.
absl::Status CheckHomesVersionHeld(const DomainVote& agreed,
                                   const std::string& group, size_t history);

}  // namespace muond
