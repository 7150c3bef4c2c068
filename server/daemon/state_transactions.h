#pragma once
// A daemon's optimizer-state operations: SaveState / LoadState, one-shot or
// in two phases, ExportState / ImportState as streams, and the rank's one
// pending transaction. DaemonCore owns a StateTransactions and delegates its
// four state RPCs to it (daemon_core.h states the rules as DaemonCore's API;
// server/daemon/state_file.h and server/common/safetensors.h the file's).
//
// The state itself (engine, registration, step ids) stays DaemonCore's: the
// transactions reach it through DaemonStateOwner under DaemonCore's own two
// locks, taken in its order (the op lock, then the state lock), so a
// transaction and a step exclude each other exactly as inside DaemonCore.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muond/v1/muond.pb.h"
#include "server/common/safetensors.h"
#include "server/daemon/registration.h"
#include "server/daemon/state_file.h"

namespace muond {

// A prepared (two-phase) save/load older than this no longer blocks another
// PREPARE on its rank: far longer than muonctl needs between PREPARE and
// COMMIT, short enough that a muonctl killed in between does not block
// save/load for long (DaemonCore::SaveState says the rule).
inline constexpr absl::Duration kPendingTransactionMaxAge = absl::Minutes(5);

// ExportState's chunks (StateHeader.max_chunk_bytes): the default and the
// bound of the data bytes per StateChunk. The daemon receives messages up to
// kMaxStateChunkBytes + kStateChunkOverheadBytes, so an ImportState chunk of
// the largest size (plus its entry name) fits too.
inline constexpr int64_t kDefaultStateChunkBytes = int64_t{1} << 20;
inline constexpr int64_t kMaxStateChunkBytes = int64_t{64} << 20;
inline constexpr int64_t kStateChunkOverheadBytes = int64_t{1} << 20;

// Concurrent state streams per daemon: each open import holds a copy of the
// whole state, each export one until it is read, so a few callers must not
// run the daemon out of memory (StateTransactions::TakeStreamSlot holds the
// rule). One trainer imports once per resume; two exports let a checkpoint
// and an operator's read overlap.
inline constexpr int kMaxImportStreams = 1;
inline constexpr int kMaxExportStreams = 2;
// An import stream with no message for this long is cancelled (its slot
// freed): its trainer hung or went away without closing the stream.
inline constexpr absl::Duration kImportIdleTimeout = absl::Seconds(60);

// A copy of the daemon's state for a file or a stream, taken under both
// locks.
struct StateSnapshot {
  std::shared_ptr<Registration> registration;
  // The registration's generation: a load prepared for one applies only
  // while it is still the current registration.
  uint64_t generation = 0;
  StateTensors state;
  StateFileInfo info;
  // Steps applied since the daemon started (a step between two phases
  // refuses the second).
  int64_t steps_done = 0;
};

// What the transactions read and change of the daemon's state. DaemonCore
// implements it; every method is called with the locks it names held.
class DaemonStateOwner {
 public:
  virtual ~DaemonStateOwner() = default;
  // State lock: the registration the step engine runs, or null while there
  // is no engine (no params registered, or no plan yet).
  virtual std::shared_ptr<Registration> EngineRegistration() const = 0;
  // State lock: counts every registration and unregistration.
  virtual uint64_t RegistrationGeneration() const = 0;
  // State lock: steps applied so far, and the last applied step id (-1:
  // none since the registration).
  virtual int64_t StepsDone() const = 0;
  virtual int64_t LastStepId() const = 0;
  // Both locks, with an engine: the engine's state and where it stands.
  virtual absl::StatusOr<StateSnapshot> CopyState() const = 0;
  // Both locks, with an engine: hands `state` to the engine; the next step
  // must be step_id + 1 (step_id -1: any, as after registration).
  virtual absl::Status RestoreState(const StateTensors& state,
                                    int64_t step_id) = 0;
  // Both locks, with an engine: what RestoreState would refuse of `state`,
  // changing nothing (a PREPARE refuses it, so no rank commits alone).
  virtual absl::Status CheckRestorable(const StateTensors& state) const = 0;
};

struct StateTransactionOptions {
  std::string job_id;
  int rank = 0;
  // How long a prepared save/load blocks another PREPARE.
  absl::Duration pending_transaction_max_age = kPendingTransactionMaxAge;
  // The largest step id a load or import may restore (DaemonCore's
  // kMaxStepId).
  int64_t max_restored_step_id = 0;
  // The operator's client_id (OperatorClientId of the daemon's token).
  std::string operator_client_id;
};

// Thread-safe: every method takes the locks it needs, except
// DropPendingOfOldRegistration, whose caller holds the state lock.
class StateTransactions {
 public:
  // op_mu and mu are DaemonCore's op and state locks; they and `owner` must
  // outlive this object.
  StateTransactions(StateTransactionOptions options, absl::Mutex* op_mu,
                    absl::Mutex* mu, DaemonStateOwner* owner);
  // Removes the temporary file of a prepared save that never committed.
  ~StateTransactions();

  // DaemonCore::SaveState, LoadState, ExportState and ImportState.
  absl::StatusOr<v1::SaveStateResponse> SaveState(
      const v1::SaveStateRequest& request,
      const std::function<bool()>& cancelled);
  absl::StatusOr<v1::LoadStateResponse> LoadState(
      const v1::LoadStateRequest& request,
      const std::function<bool()>& cancelled);
  absl::Status ExportState(
      const v1::ExportStateRequest& request,
      const std::function<bool(const v1::StateChunk&)>& write);
  absl::StatusOr<v1::ImportStateResponse> ImportState(
      const std::function<bool(v1::StateChunk*)>& read,
      const std::function<bool()>& cancelled);

  // Register/Unregister: the pending save or load was prepared for params
  // that are gone (it could never commit, yet would block every PREPARE
  // until it is stale): dropped, with a warning.
  void DropPendingOfOldRegistration() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_);

 private:
  struct StagedLoad {
    std::string transaction_id;
    uint64_t generation = 0;
    int64_t steps_done = 0;
    StateTensors state;
    int64_t step_id = -1;
    absl::Time prepared_at;
  };
  struct PendingSave {
    std::string transaction_id;
    PreparedSafetensors file;
    absl::Time prepared_at;
  };
  // ImportState's header checks (access, step id, transaction id): the
  // snapshot the chunks are written into and the entry names it expects.
  struct ImportTarget;

  absl::Status CheckStateAccess(const std::string& job_id,
                                const std::string& client_id,
                                const char* rpc) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_);
  // The engine's state and what the file needs, copied under the locks.
  absl::StatusOr<StateSnapshot> Snapshot(const std::string& job_id,
                                         const std::string& client_id,
                                         const char* rpc)
      ABSL_LOCKS_EXCLUDED(*mu_, *op_mu_);
  absl::StatusOr<v1::SaveStateResponse> CommitOrAbortSave(
      const v1::SaveStateRequest& request) ABSL_LOCKS_EXCLUDED(*mu_);
  absl::StatusOr<v1::LoadStateResponse> CommitOrAbortLoad(
      const v1::LoadStateRequest& request) ABSL_LOCKS_EXCLUDED(*mu_, *op_mu_);
  absl::StatusOr<StagedLoad> ReadAndValidate(
      const v1::LoadStateRequest& request,
      const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(*mu_, *op_mu_);
  // OK when a PREPARE of `transaction_id` may hold the rank's one pending
  // transaction: none is pending, the pending one is the same id (dropped:
  // re-prepared) or is older than the bound (dropped and logged).
  // FailedPrecondition naming the pending one otherwise.
  absl::Status ClaimPendingSlot(const std::string& transaction_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(*mu_);
  absl::StatusOr<ImportTarget> StartImport(const v1::StateHeader& header)
      ABSL_LOCKS_EXCLUDED(*mu_, *op_mu_);
  // Stages (transaction_id set) or applies a validated import.
  absl::StatusOr<v1::ImportStateResponse> FinishImport(
      const v1::StateHeader& header, ImportTarget target)
      ABSL_LOCKS_EXCLUDED(*mu_, *op_mu_);
  // Takes one of the concurrent import (or export) stream slots;
  // ResourceExhausted naming the limit when all are taken. ReturnStreamSlot
  // gives it back when the stream ends.
  absl::Status TakeStreamSlot(bool import) ABSL_LOCKS_EXCLUDED(*mu_);
  void ReturnStreamSlot(bool import) ABSL_LOCKS_EXCLUDED(*mu_);
  absl::StatusOr<v1::ImportStateResponse> ImportStream(
      const std::function<bool(v1::StateChunk*)>& read,
      const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(*mu_, *op_mu_);
  // Applies a validated state.
  absl::Status Apply(StagedLoad& staged)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(*op_mu_, *mu_);
  // The params are still the ones the staged state was read for.
  absl::Status CheckRegistrationUnchanged(const StagedLoad& staged)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(*op_mu_, *mu_);
  // What Apply would refuse now, changing nothing: a PREPARE stages only a
  // state its COMMIT can apply, so no rank of a job commits alone.
  absl::Status CheckApplicable(const StagedLoad& staged)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(*op_mu_, *mu_);

  const StateTransactionOptions options_;
  absl::Mutex* const op_mu_;
  absl::Mutex* const mu_;
  DaemonStateOwner* const owner_;
  // The two-phase save/load in progress: at most one of the two is set
  // (ClaimPendingSlot).
  std::optional<PendingSave> pending_save_ ABSL_GUARDED_BY(*mu_);
  std::optional<StagedLoad> staged_load_ ABSL_GUARDED_BY(*mu_);
  // State streams in flight (TakeStreamSlot).
  int imports_in_flight_ ABSL_GUARDED_BY(*mu_) = 0;
  int exports_in_flight_ ABSL_GUARDED_BY(*mu_) = 0;
};

}  // namespace muond
