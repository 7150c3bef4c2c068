#include "server/daemon/daemon_core.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/comm/communicator.h"
#include "core/common/echo.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/ns_load.h"
#include "server/common/operator_id.h"
#include "server/common/proto_convert.h"
#include "server/daemon/plan_binding.h"
#include "server/daemon/step_request.h"

namespace muond {
namespace {

google::protobuf::RepeatedPtrField<v1::StateBytes> StateBytesBy(
    const LayerShardedMuon& engine) {
  google::protobuf::RepeatedPtrField<v1::StateBytes> by;
  for (const StateStorageBytes& b : engine.state_bytes_by_storage()) {
    *by.Add() = StateBytesToProto(b);
  }
  return by;
}

}  // namespace

DaemonCore::DaemonCore(DaemonConfig config,
                       std::unique_ptr<HandleOpener> opener,
                       CoordinatorLink* link, EngineFactory factory)
    : config_(std::move(config)),
      own_metrics_(config_.metrics == nullptr
                       ? std::make_unique<DaemonMetrics>()
                       : nullptr),
      metrics_(config_.metrics != nullptr ? config_.metrics
                                          : own_metrics_.get()),
      opener_(std::move(opener)),
      link_(link),
      transactions_(
          {config_.job_id, config_.rank, config_.pending_transaction_max_age,
           kMaxStepId, config_.operator_client_id},
          &op_mu_, &mu_, this),
      builds_(std::move(factory)) {
  builder_ = std::thread([this] { BuilderLoop(); });
  if (config_.on_readiness) {
    readiness_ = std::thread([this] { ReadinessLoop(); });
  }
}

DaemonCore::~DaemonCore() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  builder_.join();
  if (readiness_.joinable()) readiness_.join();
  absl::MutexLock lock(&mu_);
  engine_.reset();
  registration_.reset();
}

bool DaemonCore::Ready() const {
  return engine_ != nullptr && !EngineStale() && comm_failure_.empty();
}

void DaemonCore::ReadinessLoop() {
  bool reported = false;
  while (true) {
    bool shutdown;
    {
      absl::MutexLock lock(&mu_);
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return shutdown_ || Ready() != reported;
      };
      mu_.Await(absl::Condition(&changed));
      shutdown = shutdown_;
      if (!shutdown) reported = Ready();
    }
    // Outside mu_: the callback may take its own locks. One thread reports,
    // so the reports keep their order.
    if (shutdown) {
      if (reported) config_.on_readiness(false);  // the engine goes away
      return;
    }
    config_.on_readiness(reported);
  }
}

bool DaemonCore::PlanMatches(const v1::Plan& plan) const {
  return registration_ != nullptr &&
         PlanCoversRegistration(plan, *registration_);
}

PlanHistory<v1::Plan>::Usable DaemonCore::Matches() const {
  return [this](const v1::Plan& plan) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return PlanMatches(plan);  // called under mu_ by plans_' methods
  };
}

void DaemonCore::OnPlan(const v1::Plan& plan) {
  absl::MutexLock lock(&mu_);
  if (plan.comm_epoch() > 0) {
    OnCommEpoch(plan.comm_epoch());
    return;
  }
  if (!plan.round_refused().empty()) {
    OnRoundRefused(plan.round_refused());
    return;
  }
  // The newest kPlansKept only, as the coordinator and the engine keep.
  if (!plans_.Insert(plan)) return;
  LOG(INFO) << "plan version " << plan.version()
            << " received (activates at step " << plan.activate_at_step()
            << ", " << v1::CostModel_Name(plan.cost_model()) << ")"
            << (PlanMatches(plan)
                    ? ""
                    : "; it does not match the registered params");
  if (last_step_id_ && plan.activate_at_step() <= *last_step_id_ &&
      plan.activate_at_step() > 0) {
    LOG(WARNING) << "plan version " << plan.version()
                 << " arrived after its activation step "
                 << plan.activate_at_step() << " (last step " << *last_step_id_
                 << "); it takes effect at the next step (the domain's "
                    "ranks agree on the version each step)";
  }
}

void DaemonCore::OnRoundRefused(const std::string& reason) {
  ++round_refusals_;
  round_refused_ = absl::StrCat(
      "the coordinator refused the registration round (register again on "
      "every rank): ",
      reason);
  LOG(ERROR) << round_refused_;
  // A registration waiting for its round's plan will not get one: Health
  // says so, so the trainer's wait for a plan ends now with the reason.
  if (registration_ != nullptr && engine_ == nullptr) {
    engine_error_ = round_refused_;
  }
}

bool DaemonCore::EngineStale() const {
  return engine_ != nullptr && engine_epoch_ < comm_epoch_;
}

void DaemonCore::OnCommEpoch(int64_t epoch) {
  if (epoch <= comm_epoch_) return;
  comm_epoch_ = epoch;
  if (!EngineStale()) return;
  LOG(WARNING) << "communicator epoch " << epoch
               << ": a peer's collective failed; aborting the communicators "
                  "of epoch "
               << engine_epoch_ << " and rebuilding them";
  // A step of this rank may still wait in a collective: aborting ends
  // ours, and closing the connections ends the peers' waits on us.
  for (const std::unique_ptr<Communicator>& c : engine_->communicators) {
    c->Abort();
  }
}

absl::Status DaemonCore::ReportFailedEpoch(int64_t epoch,
                                           const std::string& why) {
  absl::StatusOr<int64_t> next = link_->ReportCommFailure(epoch, why);
  if (!next.ok()) {
    LOG(WARNING) << "the communicators of epoch " << epoch
                 << " are not rebuilt: " << next.status();
    return next.status();
  }
  absl::MutexLock lock(&mu_);
  OnCommEpoch(*next);
  return absl::OkStatus();
}

std::optional<DaemonCore::BuildJob> DaemonCore::AwaitBuildJob() {
  absl::MutexLock lock(&mu_);
  auto plan_to_build = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // A rebuild rendezvouses under the plan the peers' engines were built
    // from too; a newer plan of the round is handed over as before.
    return engine_ != nullptr ? &engine_plan_ : plans_.NewestOfRound(Matches());
  };
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (shutdown_) return true;
    if (registration_ == nullptr) return false;
    if (engine_ != nullptr && !EngineStale()) return false;
    const v1::Plan* p = plan_to_build();
    // A failed build is not tried again under the same plan and epoch.
    return p != nullptr &&
           !(registration_generation_ == failed_generation_ &&
             p->version() <= failed_version_ && comm_epoch_ <= failed_epoch_);
  };
  mu_.Await(absl::Condition(&ready));
  if (shutdown_) return std::nullopt;
  BuildJob job;
  job.registration = registration_;
  job.rebuild = engine_ != nullptr;
  job.plan = *plan_to_build();
  job.plan.set_comm_epoch(comm_epoch_);
  job.generation = registration_generation_;
  return job;
}

void DaemonCore::BuilderLoop() {
  while (true) {
    std::optional<BuildJob> job = AwaitBuildJob();
    if (!job.has_value()) return;
    const int64_t epoch = job->plan.comm_epoch();
    LOG(INFO) << (job->rebuild ? "rebuilding the communicators"
                               : "creating the step engine")
              << " for plan version " << job->plan.version()
              << ", communicator epoch " << epoch;
    // The engine is dropped anyway once the registration or the epoch
    // changes, so peers are not worth waiting for after that.
    std::optional<absl::StatusOr<std::unique_ptr<StepEngine>>> built =
        builds_.Build(job->registration, job->plan, [this, &job] {
          absl::MutexLock lock(&mu_);
          return shutdown_ || job->generation != registration_generation_ ||
                 job->plan.comm_epoch() != comm_epoch_;
        });
    if (!built.has_value()) {
      LOG(INFO) << "dropped the step engine build for plan version "
                << job->plan.version() << ", epoch " << epoch
                << ": its registration or epoch is gone (it ends in the "
                   "background)";
      continue;
    }
    if (!built->ok()) {
      BuildFailed(*job, built->status());
      continue;
    }
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    InstallEngine(*job, **std::move(built));
  }
}

void DaemonCore::RememberFailedBuild(const BuildJob& job) {
  failed_generation_ = job.generation;
  failed_version_ = job.plan.version();
  failed_epoch_ = job.plan.comm_epoch();
}

void DaemonCore::BuildFailed(const BuildJob& job, const absl::Status& st) {
  const int64_t epoch = job.plan.comm_epoch();
  {
    absl::MutexLock lock(&mu_);
    if (job.generation != registration_generation_ || epoch != comm_epoch_) {
      LOG(INFO) << "dropped a failed build of a gone registration or epoch: "
                << st;
      return;
    }
    RememberFailedBuild(job);
    metrics_->EngineBuildFailed();
    if (!job.rebuild) {
      engine_error_ = st.ToString();
      LOG(ERROR) << "cannot create the step engine: " << st;
      return;
    }
    comm_failure_ =
        absl::StrCat("cannot rebuild the communicators under epoch ", epoch,
                     ": ", st.message(),
                     " (every rank's daemon must join; trying "
                     "again under a newer epoch)");
    LOG(ERROR) << comm_failure_;
    // A rendezvous fails after its timeout; anything quicker must not spin.
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutdown_;
    };
    mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Seconds(1));
    if (shutdown_) return;
  }
  // A peer that came late (stopped, slow) finds this epoch abandoned: a
  // newer one gives every rank a fresh rendezvous.
  const absl::Status reported = ReportFailedEpoch(epoch, st.ToString());
  if (!reported.ok()) {
    absl::MutexLock lock(&mu_);
    if (epoch == comm_epoch_ && job.generation == registration_generation_) {
      comm_failure_ = absl::StrCat(
          comm_failure_, "; not tried again: ", reported.message(),
          "; re-register the params on every rank, then load the last "
          "checkpoint on every rank (muonctl load)");
    }
  }
}

void DaemonCore::InstallEngine(const BuildJob& job,
                               std::unique_ptr<StepEngine> engine) {
  // The old engine's state is read only between steps.
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shutdown_ || !step_running_;
  };
  mu_.Await(absl::Condition(&idle));
  const int64_t epoch = job.plan.comm_epoch();
  if (shutdown_ || job.generation != registration_generation_ ||
      epoch != comm_epoch_ || job.rebuild != (engine_ != nullptr)) {
    LOG(INFO) << "dropped the step engine for plan version "
              << job.plan.version() << ", epoch " << epoch
              << ": its registration or epoch is gone";
    return;
  }
  if (job.rebuild) {
    // In process, bit for bit (ExportState/ImportState): the momentum and
    // moments the failed step left untouched carry on.
    absl::StatusOr<std::map<std::string, std::vector<float>>> state =
        engine_->muon->ExportState();
    const absl::Status moved =
        state.ok() ? engine->muon->ImportState(*state) : state.status();
    if (!moved.ok()) {
      comm_failure_ = absl::StrCat(
          "cannot move the optimizer state to the rebuilt communicators: ",
          moved.message(), "; re-register the params and load a checkpoint");
      RememberFailedBuild(job);
      LOG(ERROR) << comm_failure_;
      return;
    }
  }
  engine_ = std::move(engine);
  metrics_->StateBytes(StateBytesBy(*engine_->muon));
  engine_epoch_ = epoch;
  engine_plan_ = job.plan;
  engine_error_.clear();
  comm_failure_.clear();
  // The new engine is handed every version again (ActivatePlanFor).
  active_plan_version_ = 0;
  LOG(INFO) << "step engine ready (" << job.registration->num_params
            << " params, communicator epoch " << epoch << ")";
}

absl::Status DaemonCore::CheckClient(const std::string& job_id,
                                     const std::string& client_id) const {
  if (job_id != config_.job_id) {
    return absl::InvalidArgumentError(absl::StrCat("job_id: '", Echo(job_id),
                                                   "' but this daemon serves '",
                                                   config_.job_id, "'"));
  }
  if (registration_ != nullptr && client_id != registration_->client_id) {
    return absl::PermissionDeniedError(absl::StrCat(
        "client_id '", Echo(client_id), "' does not own the params",
        config_.optimizer.empty()
            ? ""
            : absl::StrCat(" of optimizer '", config_.optimizer, "'"),
        " (registered by '", registration_->client_id, "')"));
  }
  return absl::OkStatus();
}

absl::Status DaemonCore::ValidateGroups(
    const google::protobuf::RepeatedPtrField<v1::ParamGroup>& groups) const {
  if (!config_.validate_group) return absl::OkStatus();
  for (const v1::ParamGroup& group : groups) {
    RETURN_IF_ERROR(config_.validate_group(group));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Registration>> DaemonCore::CheckRegistration(
    const v1::RegisterParamsRequest& request,
    const std::function<bool()>& cancelled) {
  const absl::Status groups_valid = ValidateGroups(request.groups());
  absl::StatusOr<std::unique_ptr<Registration>> reg =
      groups_valid.ok()
          ? BuildRegistration(request, {config_.job_id, config_.world_size},
                              *opener_, cancelled)
          : absl::StatusOr<std::unique_ptr<Registration>>(groups_valid);
  if (!reg.ok() && RefusalEndsTheRound(reg.status(), request, config_.job_id)) {
    // Before the answer, so the peers' trainers hear of it as soon as this
    // one: they would otherwise wait for this rank's manifest until their
    // timeout.
    const absl::Status published =
        link_->PublishRefusal(std::string(reg.status().message()));
    if (!published.ok()) {
      LOG(WARNING) << "could not tell the coordinator of the refused "
                      "registration (peers wait for a plan until their "
                      "timeout): "
                   << published;
    }
  }
  return reg;
}

absl::StatusOr<v1::RegisterParamsResponse> DaemonCore::Register(
    const v1::RegisterParamsRequest& request,
    const std::function<bool()>& cancelled) {
  absl::StatusOr<v1::RegisterParamsResponse> outcome =
      DoRegister(request, cancelled);
  metrics_->RegistrationDone(outcome);
  return outcome;
}

absl::StatusOr<v1::RegisterParamsResponse> DaemonCore::DoRegister(
    const v1::RegisterParamsRequest& request,
    const std::function<bool()>& cancelled) {
  absl::MutexLock op(&op_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (registration_ != nullptr) {
      return WithErrorReason(
          absl::FailedPreconditionError(absl::StrCat(
              "params are already registered (", registration_->num_params,
              " params by client '", registration_->client_id,
              "'); if that trainer is gone, UnregisterParams with its "
              "client_id or as the operator (muonctl unregister) first")),
          ErrorReason::kAlreadyRegistered,
          {{"client_id", registration_->client_id}});
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Registration> reg,
                   CheckRegistration(request, cancelled));
  const v1::PublishManifestRequest manifest =
      reg->Manifest(config_.job_id, config_.rank);
  uint64_t refusals_before;
  {
    absl::MutexLock lock(&mu_);
    refusals_before = round_refusals_;
  }
  absl::StatusOr<int64_t> round_version = link_->PublishRegistration(manifest);
  if (!round_version.ok()) {
    const absl::Status& st = round_version.status();
    // An unreachable coordinator refused nothing (the link names it).
    if (absl::IsUnavailable(st)) return st;
    return WithContext(st, "the coordinator refused the manifest: ");
  }
  if (cancelled && cancelled()) {
    return absl::CancelledError(
        "the trainer disconnected during RegisterParams; nothing registered");
  }
  absl::MutexLock lock(&mu_);
  v1::RegisterParamsResponse response;
  response.set_num_params(reg->num_params);
  LOG(INFO) << "registered " << reg->num_params << " params in "
            << reg->groups.size() << " groups for client '" << reg->client_id
            << "' (" << reg->regions.size() << " memory regions)";
  registration_ = std::move(reg);
  plans_.StartRound(*round_version);
  ++registration_generation_;
  transactions_.DropPendingOfOldRegistration();
  last_step_id_.reset();
  active_plan_version_ = 0;
  // A refusal of this registration's round may arrive before its publish
  // answers (the link passes on only refusals of its latest registration).
  engine_error_ = round_refusals_ != refusals_before ? round_refused_ : "";
  comm_failure_.clear();
  if (const v1::Plan* p = plans_.NewestOfRound(Matches())) {
    response.set_plan_version(p->version());
  }
  return response;
}

absl::Status DaemonCore::Unregister(
    const v1::UnregisterParamsRequest& request) {
  absl::MutexLock op(&op_mu_);
  absl::MutexLock lock(&mu_);
  // The operator may clear a registration whose trainer is gone (it died
  // without unregistering); Step stays the owner's alone.
  const bool by_operator = request.client_id() == config_.operator_client_id;
  RETURN_IF_ERROR(
      CheckClient(request.job_id(), by_operator && registration_ != nullptr
                                        ? registration_->client_id
                                        : request.client_id()));
  if (registration_ == nullptr) return absl::OkStatus();
  LOG(INFO) << "unregistering " << registration_->num_params
            << " params of client '" << registration_->client_id << "'"
            << (by_operator ? " (by the operator)" : "");
  engine_.reset();
  comm_failure_.clear();
  registration_.reset();
  ++registration_generation_;
  transactions_.DropPendingOfOldRegistration();
  last_step_id_.reset();
  active_plan_version_ = 0;
  metrics_->Unregistered();
  return absl::OkStatus();
}

absl::Status DaemonCore::ActivatePlanFor(int64_t step_id) {
  // When every plan of the round activates later (e.g. a restarted job
  // stepping from 1 under a rebalance made for a later step) this is the
  // round's oldest, which every rank of the domain received too.
  const v1::Plan* plan = plans_.ActiveAt(step_id, Matches());
  if (plan == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no plan is active at step ", step_id,
                     " (every received plan activates later)"));
  }
  if (plan->version() == active_plan_version_) return absl::OkStatus();
  // The engine gets every version up to this one, not just this one: the
  // domain's ranks agree each step on the oldest of their newest versions,
  // so a rank may have to route by a version it skipped over while a peer
  // that received it late catches up.
  for (const v1::Plan* handed :
       plans_.HandOver(active_plan_version_, plan->version(), Matches())) {
    RETURN_IF_ERROR(SetEngineHomes(*handed, *registration_, *engine_->muon));
  }
  LOG(INFO) << "plan version " << plan->version() << " active from step "
            << step_id;
  active_plan_version_ = plan->version();
  metrics_->PlanActive(plan->version(),
                       NsLoadShare(*plan, HeldGroupsOf(*registration_)));
  return absl::OkStatus();
}

v1::StepResponse DaemonCore::ReplayedResponse() const {
  v1::StepResponse replay = last_response_;
  replay.set_replayed(true);
  return replay;
}

absl::StatusOr<v1::StepResponse> DaemonCore::Step(
    const v1::StepRequest& request,
    const std::function<absl::Status()>& await_verdict) {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::StepResponse> outcome = DoStep(request, await_verdict);
  if (outcome.ok() && !outcome->replayed()) {
    outcome->mutable_timings()->set_handler_us(
        absl::ToDoubleMicroseconds(absl::Now() - start));
  }
  metrics_->StepDone(outcome);
  ReportNsWorkspace();
  return outcome;
}

void DaemonCore::ReportNsWorkspace() {
  absl::MutexLock lock(&mu_);
  if (engine_ == nullptr) return;
  metrics_->NsWorkspace(engine_->muon->ns_workspace_bytes());
}

absl::Status DaemonCore::AwaitCommunicators(int64_t step_id) {
  const absl::Time deadline = absl::Now() + config_.comm_rebuild_wait;
  while (true) {
    int64_t unheard = -1;  // an epoch whose failure the coordinator missed
    std::string failure;
    {
      absl::MutexLock lock(&mu_);
      auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return shutdown_ || engine_ == nullptr || !EngineStale() ||
               failed_epoch_ == comm_epoch_;
      };
      mu_.AwaitWithDeadline(absl::Condition(&settled), deadline);
      if (engine_ == nullptr || shutdown_) return absl::OkStatus();
      if (comm_failure_.empty() && !EngineStale()) return absl::OkStatus();
      failure = comm_failure_;
      // Broken and no newer epoch: the report was lost (or the rebuild
      // failed and its report too); the step reports it again.
      if (!EngineStale() || failed_epoch_ == comm_epoch_) unheard = comm_epoch_;
    }
    absl::Status reported = absl::OkStatus();
    if (unheard >= 0 && absl::Now() < deadline) {
      reported = ReportFailedEpoch(unheard, failure);
      if (reported.ok()) continue;
    }
    if (absl::Now() >= deadline || unheard >= 0) {
      return WithErrorReason(
          absl::UnavailableError(absl::StrCat(
              "step ", step_id,
              " not run: the job's communicators are not usable (",
              failure.empty() ? "being rebuilt; every rank's daemon must join"
                              : failure,
              reported.ok() ? "" : "; ", reported.message(),
              "); nothing of it was applied on this rank")),
          ErrorReason::kPeerGone, {{"step_id", absl::StrCat(step_id)}});
    }
  }
}

absl::StatusOr<v1::StepResponse> DaemonCore::DoStep(
    const v1::StepRequest& request,
    const std::function<absl::Status()>& await_verdict) {
  absl::MutexLock op(&op_mu_);
  RETURN_IF_ERROR(AwaitCommunicators(request.step_id()));
  StepInputs inputs;
  LayerShardedMuon* muon = nullptr;
  bool replay = false;
  const int64_t id = request.step_id();
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckClient(request.job_id(), request.client_id()));
    if (registration_ == nullptr) {
      return absl::FailedPreconditionError(
          "step before RegisterParams: no params are registered");
    }
    replay = last_step_id_ && id == *last_step_id_;
    if (replay && (engine_ == nullptr || !comm_failure_.empty())) {
      // No engine (or no communicators) to vote with: answered from the
      // record alone, as the vote could not run on any rank either; the
      // trainer's own refusal is still a refusal (nothing to vote with).
      RETURN_IF_ERROR(TrainerRefusal(request));
      return ReplayedResponse();
    }
    if (engine_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", id,
          " before the plan: the daemon has no plan and step "
          "engine yet (waiting for the coordinator's plan",
          engine_error_.empty() ? "" : "; last error: " + engine_error_, ")"));
    }
    muon = engine_->muon.get();
    // A replay votes too (JobVerdict::kReplay): when the ranks' last step
    // ids differ, some replay and some step, and only the job vote refuses
    // it on every rank at once instead of the stepping ranks waiting for the
    // comm timeout.
    inputs.replay = replay;
    inputs.step_id = id;
    if (!replay) {
      CheckStepRequest(request, *registration_, last_step_id_, kMaxStepId,
                       inputs);
      if (inputs.refusal.ok()) {
        Refuse(inputs, ActivatePlanFor(id), RefusalCode::kPlanVersion);
      }
      if (request.await_trainer_verdict()) {
        if (await_verdict) {
          inputs.await_trainer_verdict = await_verdict;
        } else {
          Refuse(inputs,
                 absl::InvalidArgumentError(
                     "StepRequest.await_trainer_verdict: a step sent before "
                     "its trainer's checks needs a step channel (the verdict "
                     "travels in its header); over the Step RPC the trainer "
                     "checks first and leaves the field unset"),
                 RefusalCode::kOther);
        }
      }
      // The engine votes an out-of-range id as is; a refused one is never run.
      inputs.step_id = std::clamp<int64_t>(id, -1, kMaxStepId + 1);
    } else {
      // A replay its trainer refuses is refused by the job like a step:
      // answering it from the record would advance every peer's step id
      // but not the refusing trainer's.
      Refuse(inputs, TrainerRefusal(request), RefusalCode::kTrainer);
    }
    step_running_ = true;  // the builder keeps the engine until it ends
  }
  // The engine cannot go away: op_mu_ excludes Unregister/Register, and the
  // builder swaps it only between steps.
  absl::StatusOr<StepResult> result = muon->RunStep(inputs);
  {
    absl::MutexLock lock(&mu_);
    step_running_ = false;
  }
  if (!result.ok()) {
    // A withdrawn step (ABORTED) is no failure: the communicators stay, and
    // the trainers send it again.
    if (GetErrorReason(result.status()) == ErrorReason::kStepWithdrawn) {
      LOG(INFO) << "step " << id << ": " << result.status().message();
      return result.status();
    }
    LOG(ERROR) << "step " << id << " failed: " << result.status();
    if (IsCommunicationFailure(result.status())) {
      return CommunicationFailure(id, result.status());
    }
    return result.status();
  }
  absl::MutexLock lock(&mu_);
  if (replay) return ReplayedResponse();
  const v1::StepResponse response =
      StepResponseOf(request.step_id(), *result, active_plan_version_);
  last_step_id_ = request.step_id();
  last_response_ = response;
  ++steps_done_;
  if (config_.log_every > 0 && steps_done_ % config_.log_every == 0) {
    LOG(INFO) << StepLogLine(request.step_id(), result->timings,
                             active_plan_version_);
  }
  link_->ReportTimings(
      TimingsReportOf(config_.job_id, config_.rank, response, *result));
  return response;
}

absl::Status DaemonCore::CommunicationFailure(int64_t step_id,
                                              const absl::Status& st) {
  int64_t epoch;
  bool reset_by_peer;
  {
    absl::MutexLock lock(&mu_);
    epoch = engine_epoch_;
    reset_by_peer = EngineStale();
  }
  // After a timeout the coordinator has had a whole comm timeout to notice
  // a dead peer: one look, no polling (a hung peer never shows up dead, and
  // polling would add its seconds to every stalled step). A reset a peer
  // asked for names no dead peer either.
  const std::string peers =
      reset_by_peer
          ? "a peer's step failed or never came, and the job reset its "
            "communicators"
          : link_->DescribeDeadPeers(absl::IsDeadlineExceeded(st)
                                         ? absl::ZeroDuration()
                                         : absl::Seconds(3));
  // New communicators would wait for a dead peer in vain: no new epoch then
  // (the coordinator refuses one too, once it has seen the rank go).
  const bool dead_peer = absl::StartsWith(peers, kDeadRankPhrase);
  const bool reported =
      reset_by_peer ||
      (!dead_peer && ReportFailedEpoch(epoch, absl::StrCat("step ", step_id,
                                                           ": ", st.message()))
                         .ok());
  PeerFailure failure = DescribePeerFailure(step_id, st, peers, reported);
  {
    absl::MutexLock lock(&mu_);
    comm_failure_ = std::move(failure.health);
  }
  return failure.status;
}

v1::GetStatusResponse DaemonCore::Status() {
  absl::MutexLock lock(&mu_);
  v1::GetStatusResponse s;
  s.set_job_id(config_.job_id);
  s.set_rank(config_.rank);
  s.set_world_size(config_.world_size);
  s.set_device(config_.device);
  s.set_num_params(registration_ ? registration_->num_params : 0);
  s.set_last_step_id(last_step_id_.value_or(-1));
  s.set_plan_version(active_plan_version_);
  if (const v1::Plan* p = plans_.NewestOfRound(Matches())) {
    s.set_latest_plan_version(p->version());
  }
  *s.mutable_last_timings() = last_response_.timings();
  if (engine_ != nullptr) {
    s.set_state_bytes(engine_->muon->state_bytes());
    *s.mutable_state_bytes_by() = StateBytesBy(*engine_->muon);
    s.set_peak_transient_bytes(engine_->muon->peak_transient_bytes());
    s.set_ns_workspace_bytes(engine_->muon->ns_workspace_bytes());
    s.set_peak_ns_workspace_bytes(engine_->muon->peak_ns_workspace_bytes());
  }
  return s;
}

std::optional<std::string> DaemonCore::Owner() {
  absl::MutexLock lock(&mu_);
  if (registration_ == nullptr) return std::nullopt;
  return registration_->client_id;
}

v1::HealthResponse DaemonCore::Health() {
  absl::MutexLock lock(&mu_);
  v1::HealthResponse h;
  h.set_serving(true);
  // After a communication failure the engine exists but cannot step: no
  // plan, and the failure as the engine error, so nobody waits on it.
  h.set_has_plan(Ready());
  if (!comm_failure_.empty()) {
    h.set_engine_error(comm_failure_);
  } else if (EngineStale()) {
    h.set_engine_error(
        absl::StrCat("rebuilding the communicators under epoch ", comm_epoch_,
                     " (a peer's collective failed); steps wait for it"));
  } else if (engine_ == nullptr && registration_ != nullptr) {
    h.set_engine_error(engine_error_);
  }
  return h;
}

absl::StatusOr<v1::SaveStateResponse> DaemonCore::SaveState(
    const v1::SaveStateRequest& request,
    const std::function<bool()>& cancelled) {
  return transactions_.SaveState(request, cancelled);
}

absl::StatusOr<v1::LoadStateResponse> DaemonCore::LoadState(
    const v1::LoadStateRequest& request,
    const std::function<bool()>& cancelled) {
  return transactions_.LoadState(request, cancelled);
}

absl::Status DaemonCore::ExportState(
    const v1::ExportStateRequest& request,
    const std::function<bool(const v1::StateChunk&)>& write) {
  return transactions_.ExportState(request, write);
}

absl::StatusOr<v1::ImportStateResponse> DaemonCore::ImportState(
    const std::function<bool(v1::StateChunk*)>& read,
    const std::function<bool()>& cancelled) {
  return transactions_.ImportState(read, cancelled);
}

std::shared_ptr<Registration> DaemonCore::EngineRegistration() const {
  return engine_ != nullptr ? registration_ : nullptr;
}

uint64_t DaemonCore::RegistrationGeneration() const {
  return registration_generation_;
}

int64_t DaemonCore::StepsDone() const { return steps_done_; }

int64_t DaemonCore::LastStepId() const { return last_step_id_.value_or(-1); }

absl::StatusOr<StateSnapshot> DaemonCore::CopyState() const {
  StateSnapshot s;
  ASSIGN_OR_RETURN(s.state, engine_->muon->ExportState());
  s.registration = registration_;
  s.generation = registration_generation_;
  s.info = {config_.job_id, config_.rank, last_step_id_.value_or(-1),
            active_plan_version_};
  s.steps_done = steps_done_;
  return s;
}

absl::Status DaemonCore::CheckRestorable(const StateTensors& state) const {
  return engine_->muon->CheckImportState(state);
}

absl::Status DaemonCore::RestoreState(const StateTensors& state,
                                      int64_t step_id) {
  RETURN_IF_ERROR(engine_->muon->ImportState(state));
  if (step_id >= 0) {
    last_step_id_ = step_id;
    last_response_ = v1::StepResponse();
    last_response_.set_step_id(step_id);
  } else {
    last_step_id_.reset();
  }
  return absl::OkStatus();
}

std::string DaemonCore::engine_error() {
  absl::MutexLock lock(&mu_);
  return engine_error_;
}

}  // namespace muond
