#include "core/step/job_vote.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/error_reason.h"

namespace muond {

std::array<uint32_t, kJobBallotWords> EncodeJobBallot(const JobBallot& b) {
  const uint64_t id = static_cast<uint64_t>(b.step_id);
  return {static_cast<uint32_t>(b.kind), static_cast<uint32_t>(id),
          static_cast<uint32_t>(id >> 32), static_cast<uint32_t>(b.verdict),
          static_cast<uint32_t>(b.code)};
}

JobBallot DecodeJobBallot(absl::Span<const uint32_t> w) {
  const uint64_t id = uint64_t(w[1]) | (uint64_t(w[2]) << 32);
  return {.kind = static_cast<BallotKind>(w[0]),
          .step_id = static_cast<int64_t>(id),
          .verdict = static_cast<JobVerdict>(w[3]),
          .code = static_cast<RefusalCode>(w[4])};
}

JobDecision FoldJobBallots(absl::Span<const JobBallot> ballots) {
  JobDecision d;
  d.world_size = int(ballots.size());
  bool same = true;
  for (size_t r = 0; r < ballots.size(); ++r) {
    const JobBallot& b = ballots[r];
    same &= b.kind == ballots[0].kind && b.step_id == ballots[0].step_id;
    if (b.verdict == JobVerdict::kRefuse) {
      d.refusals.push_back({int(r), b.code});
    } else if (b.verdict == JobVerdict::kSkip) {
      d.skipping_ranks.push_back(int(r));
    } else if (b.verdict == JobVerdict::kReplay) {
      d.replaying_ranks.push_back(int(r));
    }
  }
  const bool mixed_replay =
      !d.replaying_ranks.empty() && d.replaying_ranks.size() != ballots.size();
  if (!d.refusals.empty() || !same || mixed_replay) {
    d.verdict = JobVerdict::kRefuse;
    d.skipping_ranks.clear();
    if (d.refusals.empty() && !same) {
      for (const JobBallot& b : ballots) d.step_ids.push_back(b.step_id);
    }
    return d;
  }
  if (!d.replaying_ranks.empty()) {
    d.verdict = JobVerdict::kReplay;
    return d;
  }
  d.verdict = d.skipping_ranks.empty() ? JobVerdict::kAgree : JobVerdict::kSkip;
  return d;
}

std::string RefusalCodeName(RefusalCode code) {
  switch (code) {
    case RefusalCode::kNone:
      return "no reason given";
    case RefusalCode::kOverrides:
      return "a step override";
    case RefusalCode::kStepId:
      return "the step id";
    case RefusalCode::kNonFinite:
      return "non-finite gradients";
    case RefusalCode::kPlanVersion:
      return "a plan version it does not hold";
    case RefusalCode::kMemory:
      return "registered memory changed";
    case RefusalCode::kCommunication:
      return "its communicators failed: a peer is gone or hung";
    case RefusalCode::kOther:
      return "another error";
    case RefusalCode::kSkipParams:
      return "a skip_params name it does not hold";
    case RefusalCode::kDomainDisagreement:
      return "its domain's ranks disagree on a group as registered, "
             "skip_params or overrides";
    case RefusalCode::kNonFiniteUpdate:
      return "a non-finite Newton-Schulz output (custom coefficients)";
    case RefusalCode::kReplicaGradients:
      return "its domain's DP replicas hold different gradients";
    case RefusalCode::kTrainer:
      return "its trainer's own checks (the error that trainer raised names "
             "the param and the rule)";
    case RefusalCode::kTrainerWithdrew:
      return "its trainer withdrew the step it sent before its checks";
  }
  return absl::StrCat("unknown reason ", uint32_t(code));
}

namespace {

// "ranks 1, 2, 3 had already applied this step (their last step id) and
// rank 0 had not", or empty when every rank or none replays. A rank whose
// trainer refused is not among the ranks that had not: its trainer refuses
// whether its daemon applied the step or not (a refused replay), and its
// refusal is the reason given.
std::string DescribeMixedReplay(const JobDecision& d, size_t world) {
  if (d.replaying_ranks.empty() || d.replaying_ranks.size() >= world) {
    return "";
  }
  auto trainer_refused = [&](int r) {
    return std::any_of(d.refusals.begin(), d.refusals.end(),
                       [&](const Refusal& f) {
                         return f.rank == r && f.code == RefusalCode::kTrainer;
                       });
  };
  std::vector<int> others;
  for (int r = 0; r < int(world); ++r) {
    if (std::find(d.replaying_ranks.begin(), d.replaying_ranks.end(), r) ==
            d.replaying_ranks.end() &&
        !trainer_refused(r)) {
      others.push_back(r);
    }
  }
  if (others.empty()) return "";
  auto ranks = [](const std::vector<int>& rs) {
    return absl::StrCat(rs.size() == 1 ? "rank " : "ranks ",
                        absl::StrJoin(rs, ", "));
  };
  return absl::StrCat(
      ranks(d.replaying_ranks),
      " had already applied this step (it is their last step id) and ",
      ranks(others),
      " had not: the ranks' last step ids differ (a LoadState or a step sent "
      "to some ranks only); LoadState the same checkpoint on every rank");
}

}  // namespace

std::string DescribeRefusals(const JobDecision& d) {
  std::vector<std::string> parts;
  if (!d.refusals.empty()) {
    std::vector<std::string> refusers;
    for (const Refusal& r : d.refusals) {
      refusers.push_back(
          absl::StrCat("rank ", r.rank, " (", RefusalCodeName(r.code), ")"));
    }
    parts.push_back(absl::StrCat("refused by ", absl::StrJoin(refusers, ", ")));
  }
  if (!d.step_ids.empty()) {
    std::vector<std::string> ids;
    for (size_t r = 0; r < d.step_ids.size(); ++r) {
      ids.push_back(absl::StrCat("rank ", r, ": ", d.step_ids[r]));
    }
    parts.push_back(absl::StrCat("the ranks voted on different steps (",
                                 absl::StrJoin(ids, ", "), ")"));
  }
  std::string mixed = DescribeMixedReplay(d, size_t(d.world_size));
  if (!mixed.empty()) parts.push_back(std::move(mixed));
  return absl::StrJoin(parts, "; ");
}

namespace {

// ErrorInfo metadata {"ranks": the ranks of the refusals `pick` keeps, "r,r"}.
template <typename Pick>
ErrorMetadata RanksOf(const std::vector<Refusal>& refusals, Pick pick) {
  std::vector<int> ranks;
  for (const Refusal& r : refusals) {
    if (pick(r)) ranks.push_back(r.rank);
  }
  return {{"ranks", absl::StrJoin(ranks, ",")}};
}

}  // namespace

absl::Status RefusedByPeers(const JobDecision& d, int64_t step_id) {
  const RefusalCode first =
      d.refusals.empty() ? RefusalCode::kStepId : d.refusals[0].code;
  const std::string message = absl::StrCat(
      "step ", step_id,
      " refused on every rank of the job: ", DescribeRefusals(d),
      " (that rank's answer has the details); nothing was applied");
  // A peer's communication failure outranks a trainer's refusal: the
  // communicators are rebuilt either way, and clients react to PEER_GONE.
  const bool communication = std::any_of(
      d.refusals.begin(), d.refusals.end(),
      [](const Refusal& r) { return r.code == RefusalCode::kCommunication; });
  const auto by_trainer = [](const Refusal& r) {
    return r.code == RefusalCode::kTrainer;
  };
  if (std::any_of(d.refusals.begin(), d.refusals.end(), by_trainer)) {
    if (communication) return absl::UnavailableError(message);
    return WithErrorReason(absl::FailedPreconditionError(message),
                           ErrorReason::kTrainerRefused,
                           RanksOf(d.refusals, by_trainer));
  }
  absl::Status status;
  switch (first) {
    case RefusalCode::kOverrides:
    case RefusalCode::kNonFinite:
    case RefusalCode::kSkipParams:
    case RefusalCode::kDomainDisagreement:
    case RefusalCode::kNonFiniteUpdate:
      status = absl::InvalidArgumentError(message);
      break;
    case RefusalCode::kCommunication:
      return absl::UnavailableError(message);
    default:
      status = absl::FailedPreconditionError(message);
  }
  // Ranks that refused (not ranks that only disagree on the step id): their
  // answers have the details.
  if (d.refusals.empty()) return status;
  return WithErrorReason(
      status, ErrorReason::kRefusedByPeer,
      RanksOf(d.refusals, [](const Refusal&) { return true; }));
}

absl::Status WithdrawnByPeers(const JobDecision& d, int64_t step_id) {
  const auto withdrew = [](const Refusal& r) {
    return r.code == RefusalCode::kTrainerWithdrew;
  };
  // Refusals no resend changes: a trainer's own (it sends no step again),
  // a failed communicator.
  const auto deliberate = [](const Refusal& r) {
    return r.code == RefusalCode::kTrainer ||
           r.code == RefusalCode::kCommunication;
  };
  if (std::none_of(d.refusals.begin(), d.refusals.end(), withdrew) ||
      std::any_of(d.refusals.begin(), d.refusals.end(), deliberate)) {
    return absl::OkStatus();
  }
  return WithErrorReason(
      absl::AbortedError(
          absl::StrCat("step ", step_id, " was not applied on any rank: ",
                       DescribeRefusals(d), "; send the same step again")),
      ErrorReason::kStepWithdrawn, RanksOf(d.refusals, withdrew));
}

absl::Status WithdrawnHere(int64_t step_id, int rank, const std::string& why) {
  return WithErrorReason(
      absl::AbortedError(absl::StrCat(
          "step ", step_id, " was withdrawn on this rank (", why,
          "); nothing was applied on any rank: send the same step again")),
      ErrorReason::kStepWithdrawn, {{"ranks", absl::StrCat(rank)}});
}

}  // namespace muond
