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
//     newest of those, some rank dropped it and every rank refuses alike;
//   * what the step does to the group: each rank brings a fingerprint of the
//     group's params it skips (StepInputs::skip_params) and one of the
//     group's hyperparameters for this step (registered values with the
//     step's overrides); ranks that differ would update the shards of one
//     param differently (or one would wait in an exchange the other skips
//     the update of), so every rank refuses alike;
//   * that replicas step on the same gradient: the ranks of a DP group hold
//     the same shards, so each brings a fingerprint of its gradients
//     (GradFingerprint, grad_fingerprint.h) and replicas whose gradients
//     differ (a trainer that did not average them across replicas) would
//     each keep momentum of their own and drift apart; every rank refuses.
// Each rank folds the votes of all ranks (its own included) the same way, so
// every rank reaches the same decision from the same gathered values.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

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
  // Mine: min = max = my fingerprint (StepFingerprint). Agreed: the smallest
  // and the largest of the ranks'; they differ iff some ranks differ.
  uint64_t skip_min = 0, skip_max = 0;
  uint64_t hyper_min = 0, hyper_max = 0;
  // Mine: the fingerprint of my gradients of the group (0: not taken, as on
  // device backends or with memory this rank must not read). Never folded:
  // only the DP group's gather compares it (GatherDomainVotesOfGroups).
  uint64_t grads = 0;
  // Agreed: every DP group of the domain brought one gradient fingerprint
  // (ranks that took none aside).
  bool replicas_agree = true;

  bool operator==(const DomainVote&) const = default;
};

// A vote travels as kDomainVoteFloats fp32 values, so one all_gather on the
// lane's backend memory carries it on any communicator:
// [all finite (1 or 0), homes_version / 2^24, homes_version % 2^24,
//  oldest_held / 2^24, oldest_held % 2^24, then each fingerprint (skip_min,
//  skip_max, hyper_min, hyper_max, grads) as three 24-bit pieces, high
//  first, then replicas_agree (1 or 0)]. fp32 holds integers below 2^24
// exactly, so versions below 2^48 and 64-bit fingerprints travel exactly.
inline constexpr int kDomainVoteFloats = 5 + 5 * 3 + 1;
inline constexpr int64_t kMaxDomainVoteVersion = (int64_t(1) << 48) - 1;

std::array<float, kDomainVoteFloats> EncodeDomainVote(const DomainVote& vote);
DomainVote DecodeDomainVote(absl::Span<const float> floats);

// Folds gathered votes (kDomainVoteFloats per rank, any number of ranks)
// into `agreed`: finite only if all are, the oldest homes_version, the newest
// oldest_held, the smallest and largest fingerprints, replicas_agree only if
// all do (`agreed.grads` stays as it was). Associative and
// commutative, so folding the gtp group's votes and then the tp group's (each
// carrying the previous fold) covers the whole domain.
DomainVote FoldDomainVotes(DomainVote agreed, absl::Span<const float> gathered);

// The homes version the domain routes by. OK when `agreed.homes_version` is
// held by every rank (0, the round-robin fallback, always is); otherwise
// FailedPrecondition naming `group`, the versions and `history` (the
// versions each rank keeps): the step is refused on every rank alike, and a
// retry works once the lagging rank caught up.
absl::Status CheckHomesVersionHeld(const DomainVote& agreed,
                                   const std::string& group, size_t history);

// A 64-bit fingerprint of bytes, the same on every rank and process (unlike
// absl::Hash) and cheap on large inputs: 8 bytes at a time, each word
// xor'ed in, multiplied by the FNV-1a 64 prime and folded (h ^= h >> 32).
// Each of those is a bijection of h, so two inputs of one layout that
// differ in a single word always give different fingerprints.
class Fingerprint {
 public:
  void Add(const void* data, size_t bytes);
  void AddWord(uint64_t word);
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 14695981039346656037ull;  // FNV-1a 64 offset basis
};

// The Fingerprint of `parts` (each part's bytes and a separator). What a
// step does to
// a group is fingerprinted as two lists of strings: the names of its params
// this rank skips, sorted, and its hyperparameters for the step, each
// "<field>=<value>" (layer_sharded_muon.cc StepOfGroup).
uint64_t StepFingerprint(absl::Span<const std::string> parts);

// OK when every rank brought the same skip and hyperparameter fingerprints;
// otherwise InvalidArgument naming `group`, what differs (the skipped params
// or this step's hyperparameters) and this rank's values (`my_skips`,
// `my_hyper`, as fingerprinted), so each rank's answer shows its side.
absl::Status CheckStepAgreed(const DomainVote& agreed, const std::string& group,
                             absl::Span<const std::string> my_skips,
                             absl::Span<const std::string> my_hyper);

// Whether the gradient fingerprints a DP group gathered (by replica d; 0:
// none taken) agree: all taken ones are equal.
bool ReplicaGradsAgree(absl::Span<const uint64_t> replica_grads);

// OK when `agreed.replicas_agree`; otherwise InvalidArgument marked as the
// replica-gradient refusal (IsReplicaGradsRefusal) naming `group`, and the
// replicas of this rank's shard (g, t) with their fingerprints when they are
// the ones that differ (`replica_grads`, by d), else that another shard's
// replicas differ.
absl::Status CheckReplicaGradsAgreed(const DomainVote& agreed,
                                     const std::string& group, int g, int t,
                                     absl::Span<const uint64_t> replica_grads);
bool IsReplicaGradsRefusal(const absl::Status& status);

}  // namespace muond
