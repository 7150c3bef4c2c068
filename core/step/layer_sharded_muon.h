#pragma once
// The layer-sharded Muon step (docs/ARCHITECTURE.md "One step") over real
// communicators.
//
// One LayerShardedMuon per daemon (process). It owns the optimizer state of
// its local shards (momentum, Adam moments) and the exchange buffers; it
// reads gradients and writes parameters in place through MatrixViews into
// trainer memory (host shm or CUDA IPC mappings, in the backend's memory
// space).
//
// Per group and step: momentum on local shards -> stage 1 all_to_allv over
// the gtp_remat group along dim 0 -> strip pad -> stage 2 over the tp group
// along tp_dim -> Newton–Schulz at the NS home (batched by shape up to
// ns_batch_size) -> scale -> reverse stage 2 -> restore pad -> reverse
// stage 1 -> weight decay + update. Replicated params run local NS on every
// rank. With a DP axis the exchanges and NS run, within each replica, only
// for the params homed there (NsHome::d); dp_share (one all_to_allv over the
// DP group) then copies each update to the other replicas before the update.
// AdamW groups update local shards without exchange.
//
// Numerics contract: with ns_batch_size = 1 every update is bit-identical to
// the duplicated path (all_gather + full NS on every rank) and to the
// single-process reference on the same backend.
//
// Thread-safety: not thread-safe; the daemon serializes calls.
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/comm/communicator.h"
#include "core/common/matrix_view.h"
#include "core/common/state_options.h"
#include "core/muon/adamw.h"
#include "core/muon/bounds.h"
#include "core/muon/muon_update.h"
#include "core/plan/plan_history.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"
#include "core/step/job_vote.h"
#include "core/step/step_overrides.h"
#include "core/step/step_result.h"

namespace muond {

// One param of a group, as this rank holds it.
struct ParamBinding {
  std::string name;
  std::vector<int64_t> full_shape;  // unsharded shape (2-D for Muon params)
  ShardTags tags;
  MatrixView param;  // local shard, updated in place (fp32 or bf16)
  MatrixView grad;   // local shard of the gradient, read only (fp32 or bf16)
};

// The domain a group is sharded over and this rank's place (d, g, t) in it.
// `gtp` and `tp` are the communicators of this rank's gtp_remat group
// ({(d, g', t)}) and tp group ({(d, g, t')}), within its replica d; `dp` that
// of its DP group ({(d', g, t)}: the ranks holding the same shards), which
// carries the dp_share phase and the domain agreement across replicas. Null
// means the axis has size 1. Not owned.
struct DomainBinding {
  DomainSize size;
  int g = 0;
  int t = 0;
  int d = 0;
  Communicator* gtp = nullptr;
  Communicator* tp = nullptr;
  Communicator* dp = nullptr;
};

struct GroupConfig {
  std::string name;
  Algorithm algorithm = Algorithm::kMuon;
  // The backend this group computes on; null: the optimizer's. Groups whose
  // domains are disjoint and that have backends of their own (on CUDA: a
  // stream each) run concurrently; groups that share a communicator or a
  // device backend run one after the other (StepOptions::concurrent_groups).
  Backend* backend = nullptr;
  MuonOptions muon;
  AdamWOptions adamw;
  DomainBinding domain;
  std::vector<ParamBinding> params;
};

// One step's inputs. `refusal`: this rank's own refusal of the step found
// before the engine (the daemon's step id sequence, its plan activation, its
// memory checks), with its code; OK: none. The step is refused on every rank
// of the job when any rank refuses it (job_vote.h).
struct StepInputs {
  int64_t step_id = 0;
  StepOverrides overrides;
  absl::Status refusal;
  RefusalCode refusal_code = RefusalCode::kNone;
  // This rank already applied `step_id` (its last one) and would answer it
  // from its record. It still votes (JobVerdict::kReplay): RunStep returns
  // an empty result when every rank replays, and refuses on every rank at
  // once when only some do (their last step ids differ) or when `refusal`
  // is set (the trainer refused it). Nothing is read or written; the domain
  // agreements run so the collectives match.
  bool replay = false;
  // Params this step leaves alone, by ParamBinding::name (the trainer's grad
  // is None, or the param does not require grad): torch.optim's rule, no
  // momentum / moment update, no weight decay, no update, an AdamW param's
  // step count unchanged. A skipped Muon param enters Newton–Schulz as zeros
  // (its peers' exchanges keep their shapes); its result is dropped. A name
  // that matches no param is refused (InvalidArgument naming it, through the
  // job vote); the ranks of a group's domain must skip the same params of it
  // (the domain agreement refuses the step otherwise). Non-skipped params
  // step bitwise as without the field.
  std::set<std::string> skip_params;
  // Set for a step its trainer sent before its own checks
  // (StepRequest.await_trainer_verdict): called once this rank's ballot is
  // cast (the momentum phase and the domain agreements done, nothing
  // written), before the job vote; it returns OK when the trainer says go,
  // else why the step is withdrawn (the trainer withdrew it, ended, or gave
  // no verdict in time). A withdrawn step is refused in the job vote on
  // every rank (ABORTED, ErrorReason kStepWithdrawn).
  std::function<absl::Status()> await_trainer_verdict;
};

struct StepOptions {
  // Run independent groups (no shared communicator or device backend) on
  // the engine's lane workers; false: every group in registration order.
  bool concurrent_groups = true;
  // Lane workers (threads started with the engine; lanes queue on them):
  // 0 = as many as the lanes, at most the cores and kMaxLaneWorkers (32,
  // lane_threads.h); on the host also at most the concurrent callers the
  // BLAS holds (cpu_backend.h). One worker runs every lane on the caller's
  // thread.
  int lane_workers = 0;
  // Non-finite gradients fail the step (default) or skip it; either way no
  // param or state changes. In a group that carries gradients in bf16
  // (fp32_matmul_prec medium, or bf16 momentum state) an fp32 gradient beyond
  // the bf16 range (|g| >= ~3.396e38, inf once rounded) counts as non-finite.
  bool skip_nonfinite = false;
  // Per-shape NS timing (StepResult::ns_shapes) on device backends: every
  // this many steps (1 = every step, 0 = never). A measured step synchronises
  // the backend after each same-shape NS chunk (a host sync per chunk, where
  // an unmeasured step's phases wait for nothing), so it is sampled. Host
  // backends run synchronously and are measured every step at no extra cost
  // (unless 0).
  int ns_shape_timing_every = 10;
  // The job communicator: every daemon of the job (rank = the daemon's rank),
  // host memory. Each step votes on it twice, before anything changes (step,
  // skip or refuse, job_vote.h) and after the exchanges (commit), so the job
  // decides together. Null: a single-rank job (no vote). Not owned.
  Communicator* job = nullptr;
  // Tests only: sleep this long before the commit vote, so a test can kill a
  // peer while every rank is known to be between its exchanges and its
  // commit (muond-daemon --testonly_commit_delay_ms). Set, the step's start
  // and the window's are logged at INFO ("testonly_commit_delay_ms: step N:
  // started", "...: exchanges done (ok)") for tests that kill a peer there.
  int testonly_commit_delay_ms = 0;
  // The Newton–Schulz workspaces of every group together take at most this
  // many bytes (0: no cap); a batch (ns_batch_size) whose workspace does not
  // fit under the cap or the backend's free memory runs in smaller batches
  // (ns_workspace_budget.h; muond-daemon --max_ns_workspace_bytes).
  int64_t max_ns_workspace_bytes = 0;
  // The exchanges of a lane's groups over one communicator run as one
  // all_to_allv per stage for as many groups, in order, as stay within this
  // many bytes by their size bound (lane_exchanges.h); a larger group
  // exchanges alone, and 0 makes every group exchange alone. A lane's
  // exchange buffers grow to its largest batch. Must be the same on every
  // rank of the job (the batches decide which collectives run): each Muon
  // group's domain agreement compares it, and ranks that differ refuse the
  // step, naming it. The daemon has no flag for it and runs the default.
  int64_t exchange_batch_bytes = int64_t{64} << 20;
};

class LayerShardedMuon {
 public:
  // Validates every group (hyperparameters, shard specs, views against
  // shapes; at most kMaxParamGroups groups, group_count.h) and returns
  // InvalidArgument naming the group/param and the rule.
  // `backend` is not owned and must outlive the optimizer.
  static absl::StatusOr<std::unique_ptr<LayerShardedMuon>> Create(
      Backend* backend, std::vector<GroupConfig> groups,
      StepOptions options = {});
  virtual ~LayerShardedMuon() = default;

  // NS homes of a Muon group, one per param in registration order (as
  // computed by PlanNsHomes over the domain), as plan `version` (>= 1; the
  // daemon passes the plan's version; kNextHomesVersion: one above the newest
  // this group holds). The homes are checked here (InvalidArgument naming the
  // group); a version set again must name the same homes.
  //
  // Not applied at once: at each Step the ranks of the group's domain agree
  // on a version, the oldest of their newest ones, and all route by it. So a
  // plan that reached one rank late is taken up by the whole domain one step
  // later instead of leaving the ranks routing by different homes. Each group
  // keeps its newest kPlansKept (64) versions; when a rank has dropped the
  // agreed version (the ranks also gather their oldest held one) every rank of
  // the domain fails the step alike (FailedPrecondition, nothing applied; a
  // retry works once the lagging rank caught up). A version missing from the
  // middle of a rank's history still fails that rank alone (its peers then time
  // out in the exchange): give every rank every version, in order. Never called
  // on any rank of the domain -> round-robin fallback (version 0) with a loud
  // warning.
  static constexpr int64_t kNextHomesVersion = -1;
  static constexpr int64_t kMaxHomesVersion = kMaxPlanVersion;
  virtual absl::Status SetHomes(const std::string& group,
                                std::vector<NsHome> homes, int64_t version) = 0;
  absl::Status SetHomes(const std::string& group, std::vector<NsHome> homes) {
    return SetHomes(group, std::move(homes), kNextHomesVersion);
  }

  // One optimizer step over every group, decided by the whole job
  // (docs/ARCHITECTURE.md "One step"): every per-rank check gives a verdict,
  // the job votes (StepOptions::job), the Muon groups run momentum (into
  // staging, the state untouched), exchanges and NS, the job votes again that
  // every rank's exchanges succeeded, and only then is anything written
  // (momentum, params, AdamW). On any error nothing was applied on this rank:
  // a refusal is answered on every rank alike (this rank's own refusal with
  // its full message; a peer's naming the peer and its code); a
  // communicator failure (Unavailable / DeadlineExceeded / Aborted) leaves
  // the communicators of this job unusable until the trainers re-register.
  // (The one window left: a peer that dies during the commit vote itself may
  // leave ranks deciding differently; there is no consensus protocol.)
  virtual absl::StatusOr<StepResult> RunStep(const StepInputs& inputs) = 0;
  // RunStep with just overrides (no step id, no refusal of its own).
  absl::StatusOr<StepResult> Step(const StepOverrides& overrides) {
    StepInputs inputs;
    inputs.overrides = overrides;
    return RunStep(inputs);
  }

  // Optimizer state of the local shards, for save/load: name -> fp32 host
  // copy ("<param>.momentum", "<param>.exp_avg", "<param>.exp_avg_sq") plus
  // the AdamW step counts. bf16 state (MuonOptions / AdamWOptions
  // state_dtype) exports widened exactly and imports rounded to nearest even;
  // fp8_e4m3 state exports dequantized exactly and imports quantized per
  // block (state_io.h), so an exported state imports back bit for bit.
  // Import checks every entry (InvalidArgument naming it) before it writes
  // any.
  virtual absl::StatusOr<std::map<std::string, std::vector<float>>>
  ExportState() const = 0;
  virtual absl::Status ImportState(
      const std::map<std::string, std::vector<float>>& state) = 0;
  // The checks ImportState makes on `state` (keys, sizes, values its dtypes
  // hold), writing nothing: a daemon refuses a load at PREPARE with them, so
  // no rank of a job commits a state another rank would refuse.
  virtual absl::Status CheckImportState(
      const std::map<std::string, std::vector<float>>& state) const = 0;

  // Bytes of persistent state and the peak of transient exchange buffers.
  virtual int64_t state_bytes() const = 0;
  // state_bytes by each group's state_location and state_dtype (MuonOptions,
  // AdamWOptions; the NorMuon/AdaMuon second moments are fp32 on the device),
  // one entry per pair holding any, ordered by location, then dtype; they add
  // up to state_bytes.
  virtual std::vector<StateStorageBytes> state_bytes_by_storage() const = 0;
  virtual int64_t peak_transient_bytes() const = 0;
  // Bytes the Newton–Schulz workspaces take now, and the most they took.
  virtual int64_t ns_workspace_bytes() const = 0;
  virtual int64_t peak_ns_workspace_bytes() const = 0;
};

}  // namespace muond
