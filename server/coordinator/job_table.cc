#include "server/coordinator/job_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/job_id.h"
#include "server/common/ns_load.h"

namespace muond {
namespace {

// A Join's host, device or address: kept per rank, logged and listed by
// ListDaemons, so bounded and printable (a host name is at most 253
// characters; a unix socket path at most 107 bytes).
absl::Status CheckJoinText(absl::string_view field, absl::string_view value) {
  constexpr size_t kMaxJoinTextBytes = 255;
  const bool printable = std::all_of(value.begin(), value.end(), [](char c) {
    return absl::ascii_isprint(static_cast<unsigned char>(c));
  });
  if (value.size() <= kMaxJoinTextBytes && printable) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": ", value.size(), " bytes \"",
      absl::CHexEscape(value.substr(0, 64)), value.size() > 64 ? "..." : "",
      "\" must be at most ", kMaxJoinTextBytes, " printable ASCII characters"));
}

}  // namespace

absl::Status JobTable::CheckJoin(const v1::JoinRequest& request,
                                 const std::string& coordinator_token) {
  RETURN_IF_ERROR(CheckCoordinatorJobId("job_id", request.job_id()));
  if (request.world_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: ", request.world_size(), " must be >= 1"));
  }
  if (request.rank() < 0 || request.rank() >= request.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: ", request.rank(),
                                                   " is outside [0, ",
                                                   request.world_size(), ")"));
  }
  RETURN_IF_ERROR(CheckJoinText("host", request.host()));
  RETURN_IF_ERROR(CheckJoinText("device", request.device()));
  RETURN_IF_ERROR(CheckJoinText("address", request.address()));
  if (!coordinator_token.empty() && request.token() != coordinator_token) {
    return absl::PermissionDeniedError(
        absl::StrCat("job '", request.job_id(), "' rank ", request.rank(),
                     ": token does not match the coordinator's"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::JoinResponse> JobTable::Join(
    const v1::JoinRequest& request) {
  const absl::Time now = options_.clock();
  ExpireIdleJobs(now);
  auto found = jobs_.find(request.job_id());
  if (found == jobs_.end() && int(jobs_.size()) >= options_.max_jobs) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", request.job_id(), "': this coordinator holds max_jobs=",
        options_.max_jobs, " jobs already (idle jobs expire after ",
        absl::FormatDuration(options_.job_idle_expiry), ")"));
  }
  std::unique_ptr<Job>& slot = jobs_[request.job_id()];
  if (slot == nullptr) {
    slot = NewJob(request);
    metrics_->JobCreated(slot->id);
  } else if (slot->waiters == 0 && !AnyLive(*slot, now, options_.join_grace) &&
             (slot->world_size != request.world_size() ||
              slot->token != request.token())) {
    // Every daemon of the old incarnation is gone: its world size and token
    // bind nobody any more.
    LOG(INFO) << "job " << slot->id << ": no daemon is live; a Join with "
              << "another world size or token starts the job afresh";
    kv_->Clear(slot->kv);
    slot = NewJob(request);
  }
  Job& job = *slot;
  job.last_activity = now;
  RETURN_IF_ERROR(CheckSameIncarnation(job, request, now));
  auto it = job.daemons.find(request.rank());
  if (it != job.daemons.end() && Live(it->second, now, options_.join_grace)) {
    const Daemon& d = it->second;
    return absl::AlreadyExistsError(absl::StrCat(
        "job '", job.id, "' rank ", request.rank(),
        " is already joined and live (from ", d.join.host(), " at ",
        d.join.address(), "; ",
        d.streams > 0
            ? "its plan stream is open"
            : absl::StrCat("joined ", absl::FormatDuration(now - d.joined_at),
                           " ago; a join with no plan stream is replaced "
                           "after ",
                           absl::FormatDuration(options_.join_grace)),
        ")"));
  }
  if (!AnyLive(job, now, options_.join_grace) && !job.kv.entries.empty()) {
    // Every daemon of the job went away and one is back (the job restarts):
    // rendezvous keys of the dead incarnation would point peers at dead
    // addresses, so the new one starts from an empty store.
    LOG(INFO) << "job " << job.id << ": every daemon had left; clearing "
              << job.kv.entries.size() << " rendezvous keys";
    kv_->Clear(job.kv);
  }
  Daemon& daemon = job.daemons[request.rank()];
  daemon.join = request;
  daemon.join.clear_token();
  daemon.streams = 0;
  daemon.join_pending = true;
  daemon.joined_at = now;
  daemon.refusals_at_join = job.refusals;
  v1::JoinResponse response;
  response.set_store_prefix(absl::StrCat("job/", job.id));
  return response;
}

absl::Status JobTable::CheckSameIncarnation(const Job& job,
                                            const v1::JoinRequest& request,
                                            absl::Time now) const {
  const bool other_world = request.world_size() != job.world_size;
  if (!other_world && request.token() == job.token) return absl::OkStatus();
  // The job's live daemons hold it (maybe a squatter, maybe this job's
  // misconfigured peers): FailedPrecondition, which the daemon waits out
  // until its join deadline, since the holders go away once their plan
  // streams end (or their join grace passes).
  int live = 0;
  for (const auto& [rank, d] : job.daemons)
    live += Live(d, now, options_.join_grace);
  const std::string holder =
      absl::StrCat("job '", job.id, "' is held by ", live, " live daemon",
                   live == 1 ? "" : "s", " of world size ", job.world_size);
  // An instance's job is named by its trainer (muond.torch.Muon's name=),
  // not by the daemon's --job_id: the way out is another name.
  const std::string fix = absl::StrCat(
      "; every daemon of a job must give the same --world_size and token: "
      "stop the daemons holding it or ",
      IsInstanceJobId(job.id) ? "give this optimizer instance another name"
                              : "give this one another --job_id",
      " (a Join waits while they are live; a join with no plan stream stops "
      "holding after ");
  if (other_world) {
    return absl::FailedPreconditionError(
        absl::StrCat("world_size: ", request.world_size(), " differs: ", holder,
                     fix, absl::FormatDuration(options_.join_grace), ")"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", request.rank(), ": token differs from the one ", holder,
      " joined with", fix, absl::FormatDuration(options_.join_grace), ")"));
}

absl::Status JobTable::CheckToken(const std::string& job_id,
                                  const std::string& token) const {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end() || it->second->token.empty()) return absl::OkStatus();
  const std::string& want = it->second->token;
  unsigned char diff = want.size() == token.size() ? 0 : 1;
  for (size_t i = 0; i < want.size() && i < token.size(); ++i)
    diff |= want[i] ^ token[i];
  if (diff != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("job '", job_id,
                     "' requires its token (metadata 'x-muond-token' or "
                     "'authorization: Bearer <token>')"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Job*> JobTable::Find(const std::string& job_id) {
  RETURN_IF_ERROR(CheckCoordinatorJobId("job_id", job_id));
  const absl::Time now = options_.clock();
  ExpireIdleJobs(now);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("job_id '", job_id,
                     "' is unknown to this coordinator (no daemon "
                     "joined it, or it expired after its daemons left)"));
  }
  it->second->last_activity = now;
  return it->second.get();
}

bool JobTable::StartWatching(const std::string& job_id, int rank) {
  auto job = jobs_.find(job_id);
  if (job == jobs_.end()) return false;
  auto it = job->second->daemons.find(rank);
  if (it == job->second->daemons.end()) return false;
  ++it->second.streams;
  it->second.join_pending = false;
  job->second->last_activity = options_.clock();
  return true;
}

void JobTable::Leave(const std::string& job_id, int rank) {
  auto job = jobs_.find(job_id);
  if (job == jobs_.end()) return;
  job->second->last_activity = options_.clock();
  auto it = job->second->daemons.find(rank);
  if (it == job->second->daemons.end()) return;
  it->second.streams = std::max(0, it->second.streams - 1);
  it->second.join_pending = false;
}

absl::StatusOr<v1::ListDaemonsResponse> JobTable::ListDaemons(
    const v1::ListDaemonsRequest& request) {
  ASSIGN_OR_RETURN(Job * job, Find(request.job_id()));
  v1::ListDaemonsResponse response;
  for (const auto& [rank, d] : job->daemons) {
    v1::DaemonInfo* info = response.add_daemons();
    info->set_rank(rank);
    info->set_host(d.join.host());
    info->set_device(d.join.device());
    info->set_address(d.join.address());
    info->set_last_step_id(d.last_step_id);
    info->set_live(Live(d, options_.clock(), options_.join_grace));
    *info->mutable_last_timings() = d.last_timings;
  }
  return response;
}

std::vector<JobMetricsSnapshot> JobTable::MetricsSnapshot() const {
  const absl::Time now = options_.clock();
  std::vector<JobMetricsSnapshot> out;
  for (const auto& [id, job] : jobs_) {
    JobMetricsSnapshot& s = out.emplace_back();
    s.job = id;
    for (const auto& [rank, d] : job->daemons)
      s.live_daemons += Live(d, now, options_.join_grace);
    if (job->plans.empty()) continue;
    const v1::Plan& plan = *job->plans.newest();
    s.plan_version = plan.version();
    for (const auto& [rank, d] : job->daemons) {
      HeldGroups held;
      for (const v1::GroupManifest& g : d.manifest.groups()) {
        held.emplace_back(g.group(), g.domain());
      }
      s.ns_load[rank] = NsLoadShare(plan, held);
    }
  }
  return out;
}

std::vector<std::string> JobTable::JobIds() const {
  std::vector<std::string> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  return ids;
}

void JobTable::ExpireIdleJobs(absl::Time now) {
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = *it->second;
    // An optimizer instance's job ("<job>/<name>") ends when its daemons
    // remove the instance, so it is forgotten as soon as none is live: a
    // process that makes many optimizers in turn does not fill --max_jobs.
    const bool instance_job = IsInstanceJobId(job.id);
    if (job.waiters > 0 || AnyLive(job, now, options_.join_grace) ||
        (!instance_job && now - job.last_activity < options_.job_idle_expiry)) {
      ++it;
      continue;
    }
    LOG(INFO) << "job " << job.id << ": no live daemon and no call for "
              << absl::FormatDuration(now - job.last_activity)
              << "; forgetting it (world size, token, store, plans)";
    kv_->Clear(job.kv);
    it = jobs_.erase(it);
  }
}

std::unique_ptr<Job> JobTable::NewJob(const v1::JoinRequest& request) const {
  auto job = std::make_unique<Job>();
  job->plans = PlanHistory<v1::Plan>(options_.plans_kept);
  job->id = request.job_id();
  job->world_size = request.world_size();
  job->token = request.token();
  job->last_activity = options_.clock();
  return job;
}

}  // namespace muond
