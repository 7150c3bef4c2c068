#pragma once
// The daemon's state machine, apart from gRPC (optimizer_service.h is the thin
// layer in front; tests drive this class in-process with fakes).
//
//  RegisterParams -> validate + map (registration.h) -> publish the manifest
//  -> (plans arrive through OnPlan) -> the builder thread creates the step
//  engine (communicators + LayerShardedMuon) from the first plan that matches
//  the registration -> Step.
//
// Step ids: the first step after registration may have any id in [0,
// kMaxStepId] (server/common/step_id.h); then each
// step must be the previous id + 1. Repeating the previous id returns the
// recorded response with replayed = true and applies nothing; a smaller id or
// a gap is FailedPrecondition naming both ids. A failed step records nothing.
// A step whose collectives fail (a peer died: Gloo transport error or
// timeout, or a communicator aborted by an earlier failure) is UNAVAILABLE
// naming the dead ranks as the coordinator sees them; nothing of it is
// applied on any rank.
//
// Healing (docs/ARCHITECTURE.md "Errors"): the communicators carry the
// job's communicator epoch in their rendezvous keys. A failed collective is
// reported to the coordinator (CoordinatorLink::ReportCommFailure), which
// moves the job's epoch once and pushes it on every plan stream; a daemon
// whose engine is of an older epoch aborts its communicators (a peer still
// waiting on this rank fails at once) and the builder thread rebuilds them
// for the same registration and plan under the new epoch, moving the
// optimizer state across in process. A Step meanwhile waits for the rebuild
// (config.comm_rebuild_wait), so the trainer resends the failed step (or
// the next) without registering again.
//
// Ownership: the client_id of RegisterParams owns the params; Step and
// UnregisterParams from any other client_id (empty included) are
// PermissionDenied, except UnregisterParams from the operator
// (server/common/operator_id.h), which clears the registration of a trainer
// that died without unregistering. RegisterParams over another client's
// registration is FailedPrecondition with ErrorReason kAlreadyRegistered.
//
// Plans (PlanHistory, core/plan/plan_history.h, holds the rules): the newest
// kPlansKept plans received are kept; only plans of the current registration
// round (version >= the round version the coordinator answered at
// RegisterParams) are used. The engine is built from the newest such plan;
// before step s the daemon activates PlanHistory::ActiveAt(s) (SetHomes per
// group), so all ranks of a domain switch at the same boundary. Plans that do
// not match the registration (other groups or param counts) are ignored.
// Losing the coordinator changes nothing: the daemon keeps stepping with its
// plans.
//
// Threads (docs/ARCHITECTURE.md "Threads"): the gRPC handlers call in; the
// core owns one builder thread (BuilderLoop, joined by the destructor) and,
// through builds_, each engine build's thread.
//
// Thread-safety: all methods are thread-safe; steps are serialized.
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/comm/communicator.h"
#include "core/plan/plan_history.h"
#include "core/step/layer_sharded_muon.h"
#include "muond/v1/muond.pb.h"
#include "server/common/operator_id.h"
#include "server/common/safetensors.h"
#include "server/common/step_id.h"
#include "server/daemon/daemon_metrics.h"
#include "server/daemon/engine_builder.h"
#include "server/daemon/memory_mapper.h"
#include "server/daemon/registration.h"
#include "server/daemon/state_file.h"
#include "server/daemon/state_transactions.h"

namespace muond {

// How DescribeDeadPeers's phrase starts when the coordinator knows a dead
// peer: then the job cannot heal by new communicators (the daemon asks for a
// re-registration instead of a new epoch).
inline constexpr char kDeadRankPhrase[] = "dead rank";

// What the daemon needs from the coordinator (coordinator_link.h over gRPC;
// fakes in tests).
class CoordinatorLink {
 public:
  virtual ~CoordinatorLink() = default;
  virtual absl::Status PublishManifest(
      const v1::PublishManifestRequest& manifest) = 0;
  // Publishes the manifest of a new registration (RegisterParams) and returns
  // the lowest plan version of its registration round: the daemon builds its
  // engine only from such a plan, never from one of an earlier round (whose
  // rendezvous keys are stale). 0 = any plan.
  virtual absl::StatusOr<int64_t> PublishRegistration(
      const v1::PublishManifestRequest& manifest) {
    absl::Status st = PublishManifest(manifest);
    if (!st.ok()) return st;
    return int64_t{0};
  }
  // Tells the coordinator that this daemon refused its trainer's
  // registration (PublishManifestRequest.registration_refused), so the job's
  // round is refused on every rank instead of the peers waiting for this
  // rank's manifest. Best effort: the trainer's answer is the refusal anyway.
  virtual absl::Status PublishRefusal(const std::string& /*reason*/) {
    return absl::OkStatus();
  }
  // Fire and forget (the latest report wins; never blocks a step).
  virtual void ReportTimings(const v1::ReportTimingsRequest& report) = 0;
  // After a collective failed: which peer ranks are gone, as a phrase for the
  // error message (e.g. "dead rank 3 (not connected to the coordinator)",
  // starting with kDeadRankPhrase).
  // May wait up to `wait` for the coordinator to notice. Empty when unknown.
  virtual std::string DescribeDeadPeers(absl::Duration /*wait*/) { return ""; }
  // This daemon's communicators of `comm_epoch` failed (a collective, or
  // their rebuild): the job's epoch after the report, which the plan stream
  // also pushes to every daemon (Plan.comm_epoch). Unimplemented: a link
  // without epochs (the daemon then cannot heal and says so).
  virtual absl::StatusOr<int64_t> ReportCommFailure(
      int64_t /*comm_epoch*/, const std::string& /*reason*/) {
    return absl::UnimplementedError("no communicator epochs on this link");
  }
};

struct DaemonConfig {
  std::string job_id;
  // The optimizer instance this core is ("" the default), for messages.
  std::string optimizer;
  int rank = 0;
  int world_size = 1;
  std::string device = "cpu";
  int log_every = 100;
  // Checks a group's hyperparameters at RegisterParams (so a bad value is
  // refused there, not when the engine is built); unset = no check.
  std::function<absl::Status(const v1::ParamGroup&)> validate_group;
  // How long a prepared save/load blocks another PREPARE (tests shorten it).
  absl::Duration pending_transaction_max_age = kPendingTransactionMaxAge;
  // Called whenever the daemon becomes able (true) or unable (false) to step
  // (DaemonCore::Ready), from the core's readiness thread, in order; the
  // grpc.health.v1 status follows it. Unset = no thread. Starts as false.
  std::function<void(bool ready)> on_readiness;
  // Where steps, registrations, plans and engine failures are counted (not
  // owned; must outlive the core); null: counted nowhere that is served.
  DaemonMetrics* metrics = nullptr;
  // The operator's client_id (server/common/operator_id.h): the daemon's
  // token's; this default is the tokenless daemon's.
  std::string operator_client_id = OperatorClientId("");
  // How long a Step waits for communicators being rebuilt (every rank's
  // daemon must rendezvous) before it answers UNAVAILABLE, PEER_GONE
  // (muond-daemon: twice --comm_timeout_s + 10 s).
  absl::Duration comm_rebuild_wait = absl::Seconds(120);
};

// DaemonStateOwner: the state its StateTransactions save, load and stream.
class DaemonCore : private DaemonStateOwner {
 public:
  DaemonCore(DaemonConfig config, std::unique_ptr<HandleOpener> opener,
             CoordinatorLink* link, EngineFactory factory);
  ~DaemonCore() override;

  // Errors: BuildRegistration's; FailedPrecondition when params are already
  // registered (UnregisterParams first); the coordinator's status when the
  // manifest is refused (then nothing stays registered). A refusal of the
  // request's own checks for this daemon's job (RefusalEndsTheRound) is
  // published to the coordinator before the answer, which refuses the job's
  // round on every rank.
  absl::StatusOr<v1::RegisterParamsResponse> Register(
      const v1::RegisterParamsRequest& request,
      const std::function<bool()>& cancelled = {});
  // InvalidArgument for a wrong job id; PermissionDenied when another client
  // registered the params and the caller is not the operator. Unregistering
  // nothing is OK.
  absl::Status Unregister(const v1::UnregisterParamsRequest& request);
  // `await_verdict`: the trainer's verdict on a step it sent before its
  // checks (a step channel's; StepRequest.await_trainer_verdict), empty
  // over the Step RPC, which refuses such a step.
  absl::StatusOr<v1::StepResponse> Step(
      const v1::StepRequest& request,
      const std::function<absl::Status()>& await_verdict = {});
  v1::GetStatusResponse Status();
  v1::HealthResponse Health();
  // The client_id that registered the params; nullopt: none registered.
  std::optional<std::string> Owner();

  // A plan from the coordinator (WatchPlans).
  // A Plan with round_refused is no plan: the coordinator refused this
  // daemon's registration round; Health reports the reason as engine_error
  // until a new registration or an engine from a plan.
  void OnPlan(const v1::Plan& plan);

  // Optimizer state of this rank's shards as a safetensors file
  // (server/daemon/state_file.h: keys, metadata and what load validates;
  // server/common/safetensors.h: how files are written and read). Load
  // restores the step id, so the next step must be step_id + 1. Shards do
  // not depend on the plan, so a file saved under one plan loads under
  // another.
  //
  // Access: the request's job_id must be this daemon's (InvalidArgument) and
  // its client_id the params' owner or the operator's
  // (server/common/operator_id.h; PermissionDenied otherwise).
  // FailedPrecondition before the engine exists.
  //
  // Phases (proto StatePhase): one-shot without one; PREPARE / COMMIT /
  // ABORT with a transaction_id for muonctl's job-wide operation. Save
  // PREPARE writes and fsyncs the file under a temporary name, COMMIT renames
  // it into place; load PREPARE reads, validates and stages the state, COMMIT
  // applies it (FailedPrecondition when the params were re-registered or a
  // step ran since the PREPARE); ABORT drops either. A COMMIT or ABORT acts
  // only on the pending transaction of its own transaction_id (and, for a
  // save, path); any other id leaves the pending one alone.
  //
  // One pending transaction per rank (save or load): a PREPARE while another
  // transaction is pending is FailedPrecondition naming the pending id and
  // its age, unless that one is older than
  // config.pending_transaction_max_age (kPendingTransactionMaxAge; its
  // muonctl died between the phases) -- then it is dropped, with a warning.
  // So a second muonctl can neither replace nor break a running one.
  // Register and Unregister drop the pending transaction (it was prepared
  // for params that are gone and could never commit).
  //
  // The file is written and read without holding mu_ or op_mu_ (Health,
  // Status and Step go on; the state is copied under the locks), and the I/O
  // stops between tensors once `cancelled` returns true (the RPC cancelled at
  // shutdown).
  absl::StatusOr<v1::SaveStateResponse> SaveState(
      const v1::SaveStateRequest& request,
      const std::function<bool()>& cancelled = {});
  absl::StatusOr<v1::LoadStateResponse> LoadState(
      const v1::LoadStateRequest& request,
      const std::function<bool()>& cancelled = {});

  // The same state streamed (proto ExportState / ImportState; entry names
  // and chunking as the proto says). Access as SaveState/LoadState. Neither
  // runs during a step: the state is copied, and applied, under the step's
  // lock.
  //
  // ExportState hands the header, then every entry in chunks of at most
  // max_chunk_bytes (0: kDefaultStateChunkBytes; 4 to kMaxStateChunkBytes,
  // else InvalidArgument), to `write`; Cancelled once `write` returns false
  // (the trainer went away).
  absl::Status ExportState(
      const v1::ExportStateRequest& request,
      const std::function<bool(const v1::StateChunk&)>& write);
  // ImportState pulls chunks from `read` (false: end of stream) into a copy
  // of the current state (so memory is bounded by the registered state's
  // size) and applies it only when the whole stream is valid
  // (StateAssembler, state_stream.h, says the rules; InvalidArgument naming the
  // entry and the rule otherwise, and nothing changes). With a transaction_id
  // it is staged as a LoadState PREPARE (the rank's one pending transaction)
  // and applied by LoadState{phase: COMMIT, transaction_id}. After it, the next
  // step id accepted is header.step_id + 1 (-1: any, as after registration);
  // header.step_id is at most kMaxStepId (a rank restored to it, like one that
  // stepped it, can only replay). Aborted, naming the step
  // ids, when a step ran on this rank between the header and the end of the
  // stream (applying it would roll this rank back while its peers stepped).
  //
  // At most kMaxImportStreams imports and kMaxExportStreams exports run at
  // once; one more is ResourceExhausted at once (nothing read or copied).
  // An import whose `cancelled` returns true at its end (the stream was
  // cancelled, e.g. idle longer than kImportIdleTimeout) applies nothing.
  absl::StatusOr<v1::ImportStateResponse> ImportState(
      const std::function<bool(v1::StateChunk*)>& read,
      const std::function<bool()>& cancelled = {});

  // The last engine creation error (empty if none), for Health/logs.
  std::string engine_error();

 private:
  // Register and Step; the public ones add the outcome to the metrics.
  absl::StatusOr<v1::RegisterParamsResponse> DoRegister(
      const v1::RegisterParamsRequest& request,
      const std::function<bool()>& cancelled);
  absl::StatusOr<v1::StepResponse> DoStep(
      const v1::StepRequest& request,
      const std::function<absl::Status()>& await_verdict);
  bool PlanMatches(const v1::Plan& plan) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one rule of readiness: an engine (built from a plan of the current
  // registration) whose communicators still work. Health's has_plan and the
  // grpc.health.v1 status both say it.
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reports every change of Ready() to config_.on_readiness. Watching the
  // predicate, instead of a call at each place the engine, registration or
  // communicators change, cannot miss a place added later.
  void ReadinessLoop();
  // PlanMatches as PlanHistory's predicate (call it under mu_).
  PlanHistory<v1::Plan>::Usable Matches() const;
  // The builder thread: builds the engine once a registration has a plan,
  // and again (the same plan, the state moved across) under each newer
  // communicator epoch.
  void BuilderLoop();
  // What BuilderLoop builds next (it waits until there is something).
  struct BuildJob {
    std::shared_ptr<Registration> registration;
    v1::Plan plan;  // comm_epoch set: the rendezvous keys name it
    uint64_t generation = 0;
    bool rebuild = false;  // an engine exists: keep its state
  };
  std::optional<BuildJob> AwaitBuildJob() ABSL_LOCKS_EXCLUDED(mu_);
  // Installs a built engine (a rebuild takes the old one's state, once no
  // step runs); false when its build is stale.
  void InstallEngine(const BuildJob& job, std::unique_ptr<StepEngine> engine)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A failed build of `job`: recorded (not retried under the same epoch and
  // plan); a failed rebuild is reported, which moves the job's epoch.
  void BuildFailed(const BuildJob& job, const absl::Status& st)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Marks `job`'s registration, plan and epoch as failed, so AwaitBuildJob
  // does not try them again (one home for the three fields below).
  void RememberFailedBuild(const BuildJob& job)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OnPlan of a Plan{comm_epoch}: a newer epoch aborts the engine's
  // communicators so the builder rebuilds them.
  void OnCommEpoch(int64_t epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engine's communicators are of an older epoch than the job's.
  bool EngineStale() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reports the engine's failed communicators (`why`) to the coordinator and
  // takes the epoch it answers; the coordinator's refusal otherwise (a rank
  // is gone, or the coordinator is unreachable).
  absl::Status ReportFailedEpoch(int64_t epoch, const std::string& why)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Before step `step_id`: waits (up to config_.comm_rebuild_wait) while
  // the communicators are being rebuilt, reporting a failure the
  // coordinator has not heard of yet. UNAVAILABLE with PEER_GONE when they
  // are still not ready.
  absl::Status AwaitCommunicators(int64_t step_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The engine's NS workspace bytes into the metrics.
  void ReportNsWorkspace() ABSL_LOCKS_EXCLUDED(mu_);
  // DaemonConfig::validate_group on every group.
  absl::Status ValidateGroups(
      const google::protobuf::RepeatedPtrField<v1::ParamGroup>& groups) const;
  // ValidateGroups + BuildRegistration; a refusal that ends the job's round
  // (RefusalEndsTheRound) is published first (CoordinatorLink::PublishRefusal).
  absl::StatusOr<std::unique_ptr<Registration>> CheckRegistration(
      const v1::RegisterParamsRequest& request,
      const std::function<bool()>& cancelled);
  // OnPlan of a Plan{round_refused}.
  void OnRoundRefused(const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckClient(const std::string& job_id,
                           const std::string& client_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ActivatePlanFor(int64_t step_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The last step's answer, marked replayed.
  v1::StepResponse ReplayedResponse() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A step whose collectives failed: UNAVAILABLE with PEER_GONE naming the
  // peers; records it for Health (the communicators are unusable now).
  absl::Status CommunicationFailure(int64_t step_id, const absl::Status& st)
      ABSL_LOCKS_EXCLUDED(mu_);

  // DaemonStateOwner, for transactions_ (under the locks it names).
  std::shared_ptr<Registration> EngineRegistration() const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t RegistrationGeneration() const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t StepsDone() const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t LastStepId() const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<StateSnapshot> CopyState() const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_, mu_);
  absl::Status RestoreState(const StateTensors& state, int64_t step_id) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_, mu_);
  absl::Status CheckRestorable(const StateTensors& state) const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(op_mu_, mu_);

  const DaemonConfig config_;
  // config_.metrics, or one of our own when it is null.
  const std::unique_ptr<DaemonMetrics> own_metrics_;
  DaemonMetrics* const metrics_;
  const std::unique_ptr<HandleOpener> opener_;
  CoordinatorLink* const link_;

  // Serializes Register/Unregister/Step/Load against each other; mu_ guards
  // the state and is what the builder thread waits on.
  absl::Mutex op_mu_;
  absl::Mutex mu_;
  std::shared_ptr<Registration> registration_ ABSL_GUARDED_BY(mu_);
  uint64_t registration_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<StepEngine> engine_ ABSL_GUARDED_BY(mu_);
  // Every plan received; its round is the current registration's.
  PlanHistory<v1::Plan> plans_ ABSL_GUARDED_BY(mu_);
  int64_t active_plan_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<int64_t> last_step_id_ ABSL_GUARDED_BY(mu_);
  v1::StepResponse last_response_ ABSL_GUARDED_BY(mu_);
  std::string engine_error_ ABSL_GUARDED_BY(mu_);
  // Refusals of registration rounds received (OnRoundRefused) and the
  // latest one's message.
  uint64_t round_refusals_ ABSL_GUARDED_BY(mu_) = 0;
  std::string round_refused_ ABSL_GUARDED_BY(mu_);
  // Set once a step's collectives failed: the communicators are aborted (or a
  // peer is gone) until they are rebuilt under a newer epoch (cleared then);
  // Health reports it (no plan, this as engine_error).
  std::string comm_failure_ ABSL_GUARDED_BY(mu_);
  // The job's communicator epoch as the coordinator last said, the epoch and
  // plan the engine's communicators were built under, and the latest epoch
  // whose build failed (-1: none), which is not built again.
  int64_t comm_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t engine_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  v1::Plan engine_plan_ ABSL_GUARDED_BY(mu_);
  int64_t failed_epoch_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t failed_version_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t failed_generation_ ABSL_GUARDED_BY(mu_) = ~uint64_t{0};
  // A step is in the engine (outside mu_): the builder swaps engines only
  // between steps.
  bool step_running_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  int64_t steps_done_ ABSL_GUARDED_BY(mu_) = 0;
  // SaveState, LoadState, ExportState, ImportState and the pending
  // transaction; it takes op_mu_ and mu_ as the methods above do.
  StateTransactions transactions_;
  // Runs the builds; used by builder_ only. Destroyed after builder_ is
  // joined (the destructor joins it first).
  EngineBuilder builds_;
  std::thread builder_;
  std::thread readiness_;  // ReadinessLoop, when config_.on_readiness is set
};

}  // namespace muond
