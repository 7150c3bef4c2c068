#include "server/coordinator/registration_rounds.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/manifest_checks.h"

namespace muond {
namespace {

// Bytes of a daemon's own refusal reason the coordinator repeats to every
// rank (a raw client could send megabytes).
constexpr size_t kMaxRefusalReasonBytes = 2048;

std::string Fingerprint(const std::map<int, std::string>& manifests) {
  std::string out;
  for (const auto& [rank, bytes] : manifests) {
    absl::StrAppend(&out, rank, ":", bytes.size(), ":", bytes, ";");
  }
  return out;
}

bool AllPublished(const Job& job) {
  int published = 0;
  for (const auto& [rank, daemon] : job.daemons)
    published += daemon.has_manifest;
  return published == job.world_size;
}

}  // namespace

absl::Status CheckNoRoundInProgress(const Job& job) {
  int published = 0, in_round = 0;
  for (const auto& [rank, daemon] : job.daemons) {
    published += daemon.has_manifest;
    in_round += daemon.has_manifest && daemon.new_round;
  }
  // A rebalance now would plan from a mix of old and new registrations and
  // leave the ranks still to publish waiting for their round's plan.
  if (published < job.world_size || (in_round > 0 && !job.plans.empty())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.id, "': registration round in progress: ",
        in_round > 0 ? in_round : published, " of ", job.world_size,
        " ranks published; retry once every rank has registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> RegistrationRounds::Publish(
    Job& job, Daemon& daemon, const v1::PublishManifestRequest& published,
    const std::string& registration, const absl::Status& valid) {
  metrics_->ManifestReceived(job.id);
  if (!published.registration_refused().empty()) {
    return RefuseOwnRegistration(job, published, registration);
  }
  RETURN_IF_ERROR(StaleForRefusedRound(job, daemon, published, registration));
  absl::StatusOr<int64_t> round =
      valid.ok() ? PublishJoined(job, daemon, published, registration)
                 : absl::StatusOr<int64_t>(valid);
  if (!round.ok()) {
    RefuseRound(job, published.rank(), registration, round.status().code(),
                absl::StrCat("registration round refused at rank ",
                             published.rank(), ": ", round.status().message()));
  }
  return round;
}

absl::Status RegistrationRounds::StaleForRefusedRound(
    const Job& job, const Daemon& daemon,
    const v1::PublishManifestRequest& published,
    const std::string& registration) const {
  if (registration.empty()) return absl::OkStatus();  // no id: judged as usual
  const absl::Status* refusal =
      registration == daemon.dropped_registration ? &daemon.dropped_by
      : registration == daemon.refused_publish    ? &daemon.refused_by
                                                  : nullptr;
  if (refusal == nullptr) return absl::OkStatus();
  // Not pushed to the plan streams: nothing changes for the other ranks, and
  // this rank hears it in the answer to its publish.
  LOG(WARNING) << "job " << job.id << ": rank " << published.rank()
               << " published registration " << registration
               << " of a refused round again; refused";
  return absl::Status(
      refusal->code(),
      absl::StrCat(refusal->message(), " (rank ", published.rank(),
                   " published its registration '", registration,
                   "' of that refused round again; register again)"));
}

absl::StatusOr<int64_t> RegistrationRounds::RefuseOwnRegistration(
    Job& job, const v1::PublishManifestRequest& published,
    const std::string& registration) {
  const int rank = published.rank();
  if (!published.groups().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, ": registration_refused is set but groups has ",
        published.groups_size(), " entries (a refusal carries no manifest)"));
  }
  std::string reason = published.registration_refused();
  if (reason.size() > kMaxRefusalReasonBytes) {
    reason.resize(kMaxRefusalReasonBytes);
    reason += "...";
  }
  RefuseRound(job, rank, registration, absl::StatusCode::kInvalidArgument,
              absl::StrCat("rank ", rank,
                           " refused its trainer's registration: ", reason));
  return job.plans.NextVersion();
}

void RegistrationRounds::RefuseRound(Job& job, int refused_rank,
                                     const std::string& registration,
                                     absl::StatusCode code,
                                     const std::string& reason) {
  // The coordinator cannot tell which side of a disagreement is wrong, nor
  // whether the daemons that published before still hold their registration
  // (muond.torch.Muon unregisters everywhere on a refusal). Keeping their
  // manifests let a retry be compared against a value of the refused attempt,
  // or complete the round with a registration nobody holds any more (a plan
  // some ranks build and others never see): the whole round goes, every rank
  // registers again.
  int dropped = 0;
  const absl::Status refusal(code, reason);
  for (auto& [rank, d] : job.daemons) {
    d.refused_registration = rank == refused_rank ? registration : "";
    if (rank == refused_rank && !registration.empty()) {
      d.refused_publish = registration;
      d.refused_by = refusal;
    }
    // Only this round's: a manifest of a completed round (a plan was made
    // from it) stays, so a raw bad PublishManifest cannot erase a running
    // job's registration (nor leave the next bad one nothing to compare with).
    if (!d.has_manifest || !d.new_round) continue;
    if (rank != refused_rank) d.refused_registration = d.registration;
    if (!d.registration.empty()) {
      d.dropped_registration = d.registration;
      d.dropped_by = refusal;
    }
    d.has_manifest = false;
    d.new_round = false;
    d.registration.clear();
    ++dropped;
  }
  ++job.refusals;
  job.refusal_reason = reason;
  job.refusal_code = code;
  LOG(WARNING) << "job " << job.id << ": " << reason << "; dropped " << dropped
               << " manifests of the round, every rank must register again";
}

absl::StatusOr<int64_t> RegistrationRounds::PublishJoined(
    Job& job_ref, Daemon& daemon, const v1::PublishManifestRequest& published,
    const std::string& registration) {
  Job* job = &job_ref;
  // The daemon's resume fields are not part of its manifest: a reconnect
  // re-publishes the same manifest with newer values.
  v1::PublishManifestRequest request = published;
  request.clear_known_plan_version();
  request.clear_last_step_id();
  for (const v1::GroupManifest& g : request.groups()) {
    const int64_t ranks = int64_t(DpSizeOf(g.domain())) *
                          int64_t(g.domain().gtp_size()) *
                          int64_t(g.domain().tp_size());
    if (ranks > job->world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group '", g.group(), "': domain '", g.domain().name(), "' ",
          DomainText(g.domain()), " has ", ranks, " ranks, more than job '",
          job->id, "' world size ", job->world_size));
    }
  }
  job->plans.RaiseFloor(published.known_plan_version(),
                        published.last_step_id());
  // Any plan computed from now on is at least this version.
  const int64_t round_version = job->plans.NextVersion();
  const std::string bytes = request.SerializeAsString();
  const bool same_manifest =
      daemon.has_manifest && daemon.manifest.SerializeAsString() == bytes;
  if (same_manifest && registration == daemon.registration) {
    return round_version;  // a daemon re-publishing after a reconnect
  }
  if (daemon.has_manifest && !same_manifest) {
    // A re-registration: start a new round, the peers publish again. A
    // peer that already published in this round (since the latest plan)
    // keeps its manifest: its registration is as new as this one, and it
    // will not publish again (e.g. a trainer's add_param_group that changed
    // only this rank's groups; the unchanged rank may publish first).
    LOG(INFO) << "job " << job->id << ": rank " << request.rank()
              << " published a new manifest; waiting for every rank again";
    for (auto& [rank, d] : job->daemons) {
      if (!d.new_round) d.has_manifest = false;
    }
  }
  RETURN_IF_ERROR(CheckAgainstPeers(*job, request));
  daemon.manifest = request;
  daemon.has_manifest = true;
  daemon.registration = registration;
  daemon.new_round = true;
  if (!AllPublished(*job)) return round_version;

  std::map<int, std::string> manifests;
  bool round_complete = true;
  for (const auto& [rank, d] : job->daemons) {
    manifests[rank] = d.manifest.SerializeAsString();
    round_complete &= d.new_round;
  }
  const std::string fingerprint = Fingerprint(manifests);
  if (fingerprint == job->planned_fingerprint && !round_complete) {
    return round_version;
  }
  // A plan for a new round serves params that have no plan yet: at once.
  // Unless this coordinator restarted under daemons that are stepping with
  // plans of its predecessor: they keep those until every rank can switch
  // together, as after a rebalance.
  const int64_t activate =
      job->plans.RoundActivationStep(rebalance_activate_margin_);
  absl::StatusOr<v1::Plan> plan =
      planner_->NextPlan(*job, CostTable{}, v1::COST_MODEL_NS_COST, activate);
  if (!plan.ok()) return plan.status();  // the caller refuses the round
  RETURN_IF_ERROR(job->plans.Append(*std::move(plan)));
  metrics_->PlanBuilt(job->id, /*rebalance=*/false);
  job->planned_fingerprint = fingerprint;
  for (auto& [rank, d] : job->daemons) d.new_round = false;
  LOG(INFO) << "job " << job->id << ": plan version "
            << job->plans.newest()->version() << " computed for "
            << job->plans.newest()->groups_size() << " groups";
  return round_version;
}

}  // namespace muond
