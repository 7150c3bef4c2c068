#include "core/step/domain_agreement.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muond {
namespace {

constexpr int64_t kLow = int64_t(1) << 24;
constexpr uint64_t kPiece = uint64_t(1) << 24;

// A 64-bit value as three floats of 24 bits (the top one holds 16).
void PutFingerprint(uint64_t v, float* out) {
  out[0] = float(v / (kPiece * kPiece));
  out[1] = float((v / kPiece) % kPiece);
  out[2] = float(v % kPiece);
}

uint64_t GetFingerprint(const float* in) {
  return (uint64_t(in[0]) * kPiece + uint64_t(in[1])) * kPiece +
         uint64_t(in[2]);
}

}  // namespace

std::array<float, kDomainVoteFloats> EncodeDomainVote(const DomainVote& vote) {
  std::array<float, kDomainVoteFloats> out = {
      vote.all_finite ? 1.0f : 0.0f, float(vote.homes_version / kLow),
      float(vote.homes_version % kLow), float(vote.oldest_held / kLow),
      float(vote.oldest_held % kLow)};
  PutFingerprint(vote.skip_min, &out[5]);
  PutFingerprint(vote.skip_max, &out[8]);
  PutFingerprint(vote.hyper_min, &out[11]);
  PutFingerprint(vote.hyper_max, &out[14]);
  PutFingerprint(vote.grads, &out[17]);
  out[20] = vote.replicas_agree ? 1.0f : 0.0f;
  return out;
}

DomainVote DecodeDomainVote(absl::Span<const float> f) {
  return {.all_finite = f[0] == 1.0f,
          .homes_version = int64_t(f[1]) * kLow + int64_t(f[2]),
          .oldest_held = int64_t(f[3]) * kLow + int64_t(f[4]),
          .skip_min = GetFingerprint(&f[5]),
          .skip_max = GetFingerprint(&f[8]),
          .hyper_min = GetFingerprint(&f[11]),
          .hyper_max = GetFingerprint(&f[14]),
          .grads = GetFingerprint(&f[17]),
          .replicas_agree = f[20] == 1.0f};
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
    agreed.skip_min = std::min(agreed.skip_min, rank.skip_min);
    agreed.skip_max = std::max(agreed.skip_max, rank.skip_max);
    agreed.hyper_min = std::min(agreed.hyper_min, rank.hyper_min);
    agreed.hyper_max = std::max(agreed.hyper_max, rank.hyper_max);
    agreed.replicas_agree = agreed.replicas_agree && rank.replicas_agree;
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

void Fingerprint::AddWord(uint64_t word) {
  h_ ^= word;
  h_ *= 1099511628211ull;  // FNV-1a 64 prime
  h_ ^= h_ >> 32;          // carries the high bits down to the next words
}

void Fingerprint::Add(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  size_t at = 0;
  for (; at + 8 <= bytes; at += 8) {
    uint64_t word;
    std::memcpy(&word, p + at, 8);
    AddWord(word);
  }
  for (; at < bytes; ++at) AddWord(p[at]);
}

uint64_t StepFingerprint(absl::Span<const std::string> parts) {
  Fingerprint f;
  for (const std::string& part : parts) {
    f.Add(part.data(), part.size());
    f.AddWord(uint64_t(1) << 63);  // ["ab"] and ["a", "b"] differ
  }
  return f.value();
}

absl::Status CheckStepAgreed(const DomainVote& agreed, const std::string& group,
                             absl::Span<const std::string> my_skips,
                             absl::Span<const std::string> my_hyper) {
  const bool skips_differ = agreed.skip_min != agreed.skip_max;
  const bool hyper_differ = agreed.hyper_min != agreed.hyper_max;
  if (!skips_differ && !hyper_differ) return absl::OkStatus();
  std::string what;
  if (skips_differ) {
    what = absl::StrCat(
        "which of its params to skip (skip_params; this rank "
        "skips [",
        absl::StrJoin(my_skips, ", "), "])");
  }
  if (hyper_differ) {
    absl::StrAppend(&what, skips_differ ? " and " : "",
                    "the group as registered (its name, algorithm, "
                    "precision, params and their full shapes: were a "
                    "communicator's groups registered in another order?), "
                    "this step's hyperparameters (overrides) or the engine's "
                    "exchange_batch_bytes (StepOptions) (this rank's: ",
                    absl::StrJoin(my_hyper, ", "), ")");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "group '", group, "': the ranks of its domain disagree on ", what,
      "; every rank holding a shard of the group must send the same; the "
      "step was not applied on any rank"));
}

}  // namespace muond

namespace muond {
namespace {
constexpr char kReplicaGradsUrl[] = "muond/refusal/replica-gradients";
}  // namespace

bool ReplicaGradsAgree(absl::Span<const uint64_t> replica_grads) {
  uint64_t seen = 0;
  for (uint64_t f : replica_grads) {
    if (f == 0) continue;
    if (seen != 0 && f != seen) return false;
    seen = f;
  }
  return true;
}

absl::Status CheckReplicaGradsAgreed(const DomainVote& agreed,
                                     const std::string& group, int g, int t,
                                     absl::Span<const uint64_t> replica_grads) {
  if (agreed.replicas_agree) return absl::OkStatus();
  std::string which;
  if (ReplicaGradsAgree(replica_grads)) {
    which = absl::StrCat("the DP replicas of another shard of its domain");
  } else {
    std::vector<std::string> each;
    for (size_t d = 0; d < replica_grads.size(); ++d) {
      each.push_back(absl::StrCat(
          "d=", d, ": ",
          replica_grads[d] == 0
              ? "not taken"
              : absl::StrCat("0x",
                             absl::Hex(replica_grads[d], absl::kZeroPad16))));
    }
    which = absl::StrCat("its DP replicas of shard (g=", g, ", t=", t, ") (",
                         absl::StrJoin(each, ", "), ")");
  }
  absl::Status refused = absl::InvalidArgumentError(absl::StrCat(
      "group '", group, "': ", which,
      " hold different gradients; replicas must step on the same gradient "
      "(average it across them first, as DDP's all-reduce does), or each "
      "keeps momentum of its own and they drift apart; the step was not "
      "applied on any rank"));
  refused.SetPayload(kReplicaGradsUrl, absl::Cord("1"));
  return refused;
}

bool IsReplicaGradsRefusal(const absl::Status& status) {
  return status.GetPayload(kReplicaGradsUrl).has_value();
}

}  // namespace muond
