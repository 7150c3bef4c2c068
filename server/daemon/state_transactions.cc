#include "server/daemon/state_transactions.h"

#include <memory>
#include <type_traits>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/daemon/state_stream.h"

namespace muond {

namespace {

constexpr size_t kMaxTransactionIdBytes = 128;

absl::Status CheckTransactionId(const std::string& id) {
  if (id.size() > kMaxTransactionIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transaction_id: at most ", kMaxTransactionIdBytes, " bytes"));
  }
  return absl::OkStatus();
}

// What every request checks before any lock or file: a path (not for a load
// COMMIT/ABORT, which may end an ImportState's transaction), and a
// transaction id exactly when there is a phase.
template <typename Request>
absl::Status CheckRequest(const Request& request) {
  const bool ends_load = std::is_same_v<Request, v1::LoadStateRequest> &&
                         (request.phase() == v1::STATE_PHASE_COMMIT ||
                          request.phase() == v1::STATE_PHASE_ABORT);
  if (request.path().empty() && !ends_load) {
    return absl::InvalidArgumentError("path: must not be empty");
  }
  const bool phased = request.phase() != v1::STATE_PHASE_UNSPECIFIED;
  if (!v1::StatePhase_IsValid(request.phase())) {
    return absl::InvalidArgumentError(
        absl::StrCat("phase: unknown value ", int(request.phase())));
  }
  if (phased && (request.transaction_id().empty() ||
                 request.transaction_id().size() > kMaxTransactionIdBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("transaction_id: required with a phase, 1 to ",
                     kMaxTransactionIdBytes, " bytes"));
  }
  return absl::OkStatus();
}

// An age for a message: "0s", not absl's bare "0", under a millisecond.
std::string FormatAge(absl::Duration age) {
  age = absl::Trunc(age, absl::Milliseconds(1));
  return age == absl::ZeroDuration() ? "0s" : absl::FormatDuration(age);
}

absl::Status NoSuchTransaction(const char* what, const std::string& id) {
  return absl::FailedPreconditionError(
      absl::StrCat("no prepared ", what, " with transaction_id '", id,
                   "' (never prepared, dropped as stale, or already "
                   "committed/aborted)"));
}

}  // namespace

StateTransactions::StateTransactions(StateTransactionOptions options,
                                     absl::Mutex* op_mu, absl::Mutex* mu,
                                     DaemonStateOwner* owner)
    : options_(std::move(options)), op_mu_(op_mu), mu_(mu), owner_(owner) {}

StateTransactions::~StateTransactions() {
  absl::MutexLock lock(mu_);
  if (pending_save_) AbortSafetensors(pending_save_->file);  // its temp file
}

absl::Status StateTransactions::CheckStateAccess(const std::string& job_id,
                                                 const std::string& client_id,
                                                 const char* rpc) const {
  if (job_id != options_.job_id) {
    return absl::InvalidArgumentError(absl::StrCat("job_id: '", job_id,
                                                   "' but this daemon serves '",
                                                   options_.job_id, "'"));
  }
  const std::shared_ptr<Registration> registration =
      owner_->EngineRegistration();
  if (registration == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(rpc,
                     " before the step engine exists (register params "
                     "and wait for the plan)"));
  }
  if (client_id != registration->client_id &&
      client_id != options_.operator_client_id) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, ": client_id '", client_id.substr(0, 128),
        "' neither owns the params nor is the operator's (derived from the "
        "daemon's token, as muonctl sends it)"));
  }
  return absl::OkStatus();
}

absl::Status StateTransactions::ClaimPendingSlot(
    const std::string& transaction_id) {
  if (!pending_save_ && !staged_load_) return absl::OkStatus();
  const char* kind = pending_save_ ? "save" : "load";
  const std::string& pending_id = pending_save_ ? pending_save_->transaction_id
                                                : staged_load_->transaction_id;
  const absl::Duration age =
      absl::Now() -
      (pending_save_ ? pending_save_->prepared_at : staged_load_->prepared_at);
  if (pending_id != transaction_id &&
      age < options_.pending_transaction_max_age) {
    return absl::FailedPreconditionError(absl::StrCat(
        "transaction_id '", transaction_id, "': rank ", options_.rank,
        " has the ", kind, " of transaction '", pending_id,
        "' pending (prepared ", FormatAge(age),
        " ago); one transaction at a time: wait for its COMMIT/ABORT, or ",
        absl::FormatDuration(options_.pending_transaction_max_age),
        " after its PREPARE when it is dropped as stale"));
  }
  if (pending_id != transaction_id) {
    LOG(WARNING) << "dropping the " << kind << " of transaction " << pending_id
                 << ", prepared " << absl::FormatDuration(age)
                 << " ago and never committed or aborted, for transaction "
                 << transaction_id;
  }
  if (pending_save_) AbortSafetensors(pending_save_->file);
  pending_save_.reset();
  staged_load_.reset();
  return absl::OkStatus();
}

void StateTransactions::DropPendingOfOldRegistration() {
  if (!pending_save_ && !staged_load_) return;
  LOG(WARNING) << "dropping the pending " << (pending_save_ ? "save" : "load")
               << " of transaction "
               << (pending_save_ ? pending_save_->transaction_id
                                 : staged_load_->transaction_id)
               << ": the params it was prepared for were unregistered";
  if (pending_save_) AbortSafetensors(pending_save_->file);
  pending_save_.reset();
  staged_load_.reset();
}

absl::StatusOr<StateSnapshot> StateTransactions::Snapshot(
    const std::string& job_id, const std::string& client_id, const char* rpc) {
  // op_mu_: no step is half-way through the state being copied.
  absl::MutexLock op(op_mu_);
  absl::MutexLock lock(mu_);
  RETURN_IF_ERROR(CheckStateAccess(job_id, client_id, rpc));
  return owner_->CopyState();
}

absl::StatusOr<v1::SaveStateResponse> StateTransactions::SaveState(
    const v1::SaveStateRequest& request,
    const std::function<bool()>& cancelled) {
  RETURN_IF_ERROR(CheckRequest(request));
  if (request.phase() == v1::STATE_PHASE_COMMIT ||
      request.phase() == v1::STATE_PHASE_ABORT) {
    return CommitOrAbortSave(request);
  }
  const bool prepare = request.phase() == v1::STATE_PHASE_PREPARE;
  if (prepare) {
    // Refused before the file is written; checked again below (a PREPARE
    // racing this one).
    absl::MutexLock lock(mu_);
    RETURN_IF_ERROR(
        CheckStateAccess(request.job_id(), request.client_id(), "SaveState"));
    RETURN_IF_ERROR(ClaimPendingSlot(request.transaction_id()));
  }
  ASSIGN_OR_RETURN(
      StateSnapshot snap,
      Snapshot(request.job_id(), request.client_id(), "SaveState"));
  // The file is built and written without the locks.
  const size_t tensors = snap.state.size();
  const SafetensorsFile file =
      StateToFile(*snap.registration, std::move(snap.state), snap.info);
  ASSIGN_OR_RETURN(PreparedSafetensors prepared,
                   PrepareSafetensors(request.path(), file, cancelled));
  v1::SaveStateResponse response;
  response.set_path(request.path());
  response.set_bytes(prepared.bytes);
  response.set_step_id(snap.info.step_id);
  if (prepare) {
    absl::MutexLock lock(mu_);
    if (absl::Status st = ClaimPendingSlot(request.transaction_id());
        !st.ok()) {
      AbortSafetensors(prepared);
      return st;
    }
    pending_save_ =
        PendingSave{request.transaction_id(), std::move(prepared), absl::Now()};
    LOG(INFO) << "prepared the save of " << tensors << " state tensors to "
              << request.path() << " (transaction " << request.transaction_id()
              << ")";
    return response;
  }
  RETURN_IF_ERROR(CommitSafetensors(prepared));
  LOG(INFO) << "saved " << tensors << " state tensors (" << prepared.bytes
            << " bytes, step " << snap.info.step_id << ") to "
            << request.path();
  return response;
}

absl::StatusOr<v1::SaveStateResponse> StateTransactions::CommitOrAbortSave(
    const v1::SaveStateRequest& request) {
  std::optional<PendingSave> pending;
  {
    absl::MutexLock lock(mu_);
    RETURN_IF_ERROR(
        CheckStateAccess(request.job_id(), request.client_id(), "SaveState"));
    if (pending_save_ &&
        pending_save_->transaction_id == request.transaction_id() &&
        pending_save_->file.path == request.path()) {
      pending.swap(pending_save_);
    }
  }
  v1::SaveStateResponse response;
  response.set_path(request.path());
  if (request.phase() == v1::STATE_PHASE_ABORT) {
    // Idempotent: aborting what is gone is done.
    if (pending) AbortSafetensors(pending->file);
    return response;
  }
  if (!pending) return NoSuchTransaction("save", request.transaction_id());
  RETURN_IF_ERROR(CommitSafetensors(pending->file));
  response.set_bytes(pending->file.bytes);
  LOG(INFO) << "committed the save to " << request.path() << " (transaction "
            << request.transaction_id() << ")";
  return response;
}

absl::StatusOr<StateTransactions::StagedLoad>
StateTransactions::ReadAndValidate(const v1::LoadStateRequest& request,
                                   const std::function<bool()>& cancelled) {
  {
    // Refuse strangers before touching their file.
    absl::MutexLock lock(mu_);
    RETURN_IF_ERROR(
        CheckStateAccess(request.job_id(), request.client_id(), "LoadState"));
  }
  ASSIGN_OR_RETURN(SafetensorsFile file,
                   ReadSafetensors(request.path(), cancelled));
  // The current state tells which tensors and sizes the engine expects.
  ASSIGN_OR_RETURN(
      StateSnapshot snap,
      Snapshot(request.job_id(), request.client_id(), "LoadState"));
  ASSIGN_OR_RETURN(
      LoadedState loaded,
      StateFromFile(request.path(), std::move(file), *snap.registration,
                    snap.state, options_.job_id,
                    options_.max_restored_step_id));
  StagedLoad staged;
  staged.transaction_id = request.transaction_id();
  staged.generation = snap.generation;
  staged.state = std::move(loaded.state);
  staged.step_id = loaded.step_id;
  return staged;
}

absl::Status StateTransactions::CheckRegistrationUnchanged(
    const StagedLoad& staged) {
  if (owner_->RegistrationGeneration() != staged.generation ||
      owner_->EngineRegistration() == nullptr) {
    return absl::FailedPreconditionError(
        "LoadState: the params were re-registered since the file was read; "
        "load again");
  }
  return absl::OkStatus();
}

absl::Status StateTransactions::CheckApplicable(const StagedLoad& staged) {
  RETURN_IF_ERROR(CheckRegistrationUnchanged(staged));
  return owner_->CheckRestorable(staged.state);
}

absl::Status StateTransactions::Apply(StagedLoad& staged) {
  // RestoreState checks the values itself before it writes any.
  RETURN_IF_ERROR(CheckRegistrationUnchanged(staged));
  return owner_->RestoreState(staged.state, staged.step_id);
}

absl::StatusOr<v1::LoadStateResponse> StateTransactions::LoadState(
    const v1::LoadStateRequest& request,
    const std::function<bool()>& cancelled) {
  RETURN_IF_ERROR(CheckRequest(request));
  if (request.phase() == v1::STATE_PHASE_COMMIT ||
      request.phase() == v1::STATE_PHASE_ABORT) {
    return CommitOrAbortLoad(request);
  }
  const bool prepare = request.phase() == v1::STATE_PHASE_PREPARE;
  if (prepare) {
    // Refused before the file is read; checked again below.
    absl::MutexLock lock(mu_);
    RETURN_IF_ERROR(
        CheckStateAccess(request.job_id(), request.client_id(), "LoadState"));
    RETURN_IF_ERROR(ClaimPendingSlot(request.transaction_id()));
  }
  ASSIGN_OR_RETURN(StagedLoad staged, ReadAndValidate(request, cancelled));
  v1::LoadStateResponse response;
  response.set_step_id(staged.step_id);
  response.set_job_id(options_.job_id);
  const size_t tensors = staged.state.size();
  absl::MutexLock op(op_mu_);
  absl::MutexLock lock(mu_);
  if (prepare) {
    RETURN_IF_ERROR(ClaimPendingSlot(request.transaction_id()));
    RETURN_IF_ERROR(CheckApplicable(staged));
    staged.steps_done = owner_->StepsDone();
    staged.prepared_at = absl::Now();
    staged_load_ = std::move(staged);
    LOG(INFO) << "prepared the load of " << tensors << " state tensors from "
              << request.path() << " (step " << response.step_id()
              << ", transaction " << request.transaction_id() << ")";
    return response;
  }
  RETURN_IF_ERROR(Apply(staged));
  LOG(INFO) << "loaded " << tensors << " state tensors from " << request.path()
            << " (step " << response.step_id() << ")";
  return response;
}

absl::StatusOr<v1::LoadStateResponse> StateTransactions::CommitOrAbortLoad(
    const v1::LoadStateRequest& request) {
  absl::MutexLock op(op_mu_);
  absl::MutexLock lock(mu_);
  RETURN_IF_ERROR(
      CheckStateAccess(request.job_id(), request.client_id(), "LoadState"));
  const bool ours =
      staged_load_ && staged_load_->transaction_id == request.transaction_id();
  v1::LoadStateResponse response;
  response.set_job_id(options_.job_id);
  if (request.phase() == v1::STATE_PHASE_ABORT) {
    if (ours) staged_load_.reset();
    return response;
  }
  if (!ours) return NoSuchTransaction("load", request.transaction_id());
  StagedLoad staged = *std::move(staged_load_);
  staged_load_.reset();
  if (staged.steps_done != owner_->StepsDone()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "LoadState COMMIT: a step ran since the PREPARE of transaction '",
        request.transaction_id(), "'; pause the trainers and load again"));
  }
  RETURN_IF_ERROR(Apply(staged));
  response.set_step_id(staged.step_id);
  LOG(INFO) << "committed the load of transaction " << request.transaction_id()
            << " (step " << staged.step_id << ")";
  return response;
}

absl::Status StateTransactions::TakeStreamSlot(bool import) {
  absl::MutexLock lock(mu_);
  int& in_flight = import ? imports_in_flight_ : exports_in_flight_;
  const int limit = import ? kMaxImportStreams : kMaxExportStreams;
  if (in_flight >= limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        import ? "ImportState" : "ExportState", ": ", in_flight,
        " streams already in flight on this daemon, the limit is ", limit,
        " (each holds a copy of the whole state); retry when one ends"));
  }
  ++in_flight;
  return absl::OkStatus();
}

void StateTransactions::ReturnStreamSlot(bool import) {
  absl::MutexLock lock(mu_);
  --(import ? imports_in_flight_ : exports_in_flight_);
}

absl::Status StateTransactions::ExportState(
    const v1::ExportStateRequest& request,
    const std::function<bool(const v1::StateChunk&)>& write) {
  RETURN_IF_ERROR(TakeStreamSlot(/*import=*/false));
  absl::Cleanup slot = [this] { ReturnStreamSlot(/*import=*/false); };
  const v1::StateHeader& asked = request.header();
  int64_t chunk_bytes = asked.max_chunk_bytes();
  if (chunk_bytes == 0) chunk_bytes = kDefaultStateChunkBytes;
  if (chunk_bytes < int64_t(sizeof(float)) ||
      chunk_bytes > kMaxStateChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_chunk_bytes: ", asked.max_chunk_bytes(), " is not 0 (",
        kDefaultStateChunkBytes, ") or in [4, ", kMaxStateChunkBytes, "]"));
  }
  ASSIGN_OR_RETURN(StateSnapshot snap,
                   Snapshot(asked.job_id(), asked.client_id(), "ExportState"));
  // Streamed without the locks: steps go on while the trainer reads.
  v1::StateChunk first;
  v1::StateHeader* header = first.mutable_header();
  header->set_job_id(options_.job_id);
  header->set_client_id(asked.client_id());
  header->set_step_id(snap.info.step_id);
  header->set_max_chunk_bytes(chunk_bytes);
  header->set_num_entries(int64_t(snap.state.size()));
  const StateEntryNames names(*snap.registration);
  if (!write(first) ||
      !WriteStateChunks(snap.state, names, chunk_bytes / int64_t(sizeof(float)),
                        write)) {
    return absl::CancelledError("ExportState: the trainer went away");
  }
  return absl::OkStatus();
}

struct StateTransactions::ImportTarget {
  StagedLoad staged;  // the current state's copy, to be overwritten
  std::shared_ptr<Registration> registration;
  // The rank's steps when the header arrived (a step since: refused).
  int64_t steps_done = 0;
  int64_t last_step_id = -1;
};

absl::StatusOr<StateTransactions::ImportTarget> StateTransactions::StartImport(
    const v1::StateHeader& header) {
  RETURN_IF_ERROR(CheckTransactionId(header.transaction_id()));
  if (header.step_id() < -1 ||
      header.step_id() > options_.max_restored_step_id) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step_id: ", header.step_id(), " is not in [-1, ",
        options_.max_restored_step_id,
        "] (the next step, step_id + 1, must be a valid step id)"));
  }
  if (!header.transaction_id().empty()) {
    // Refused before the data is read; claimed again when staging.
    absl::MutexLock lock(mu_);
    RETURN_IF_ERROR(
        CheckStateAccess(header.job_id(), header.client_id(), "ImportState"));
    RETURN_IF_ERROR(ClaimPendingSlot(header.transaction_id()));
  }
  ASSIGN_OR_RETURN(
      StateSnapshot snap,
      Snapshot(header.job_id(), header.client_id(), "ImportState"));
  ImportTarget target;
  target.staged.transaction_id = header.transaction_id();
  target.staged.generation = snap.generation;
  target.staged.state = std::move(snap.state);
  target.staged.step_id = header.step_id();
  target.registration = std::move(snap.registration);
  target.steps_done = snap.steps_done;
  target.last_step_id = snap.info.step_id;
  return target;
}

absl::StatusOr<v1::ImportStateResponse> StateTransactions::ImportState(
    const std::function<bool(v1::StateChunk*)>& read,
    const std::function<bool()>& cancelled) {
  RETURN_IF_ERROR(TakeStreamSlot(/*import=*/true));
  absl::Cleanup slot = [this] { ReturnStreamSlot(/*import=*/true); };
  return ImportStream(read, cancelled);
}

absl::StatusOr<v1::ImportStateResponse> StateTransactions::ImportStream(
    const std::function<bool(v1::StateChunk*)>& read,
    const std::function<bool()>& cancelled) {
  v1::StateChunk chunk;
  if (!read(&chunk) || !chunk.has_header() || !chunk.entry().empty()) {
    return absl::InvalidArgumentError(
        "ImportState: the stream's first message must carry the header "
        "(and no entry)");
  }
  const v1::StateHeader header = chunk.header();
  ASSIGN_OR_RETURN(ImportTarget target, StartImport(header));
  // Assembled without the locks: steps go on while the trainer sends.
  const StateEntryNames names(*target.registration);
  StateAssembler assembler(&target.staged.state, names);
  while (read(&chunk)) RETURN_IF_ERROR(assembler.Add(chunk));
  // A cancelled stream also ends reads: it is no complete import.
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat(
        "ImportState: the stream was cancelled (the trainer went away, or "
        "sent no message for longer than the idle bound, kImportIdleTimeout); "
        "nothing was imported"));
  }
  RETURN_IF_ERROR(assembler.Finish());
  return FinishImport(header, std::move(target));
}

absl::StatusOr<v1::ImportStateResponse> StateTransactions::FinishImport(
    const v1::StateHeader& header, ImportTarget target) {
  StagedLoad& staged = target.staged;
  v1::ImportStateResponse response;
  response.set_step_id(staged.step_id);
  response.set_num_entries(int64_t(staged.state.size()));
  absl::MutexLock op(op_mu_);
  absl::MutexLock lock(mu_);
  // The trainer's state is from before the header; applying it after a step
  // would roll this rank back while its peers keep that step (as a LoadState
  // COMMIT after a step is refused).
  if (owner_->StepsDone() != target.steps_done) {
    return absl::AbortedError(absl::StrCat(
        "ImportState: a step ran on this rank while the stream was sent (last "
        "step_id ",
        target.last_step_id, " at the header, ", owner_->LastStepId(),
        " now); nothing was imported; pause the trainers and import again"));
  }
  if (!header.transaction_id().empty()) {
    RETURN_IF_ERROR(ClaimPendingSlot(header.transaction_id()));
    RETURN_IF_ERROR(CheckApplicable(staged));
    staged.steps_done = owner_->StepsDone();
    staged.prepared_at = absl::Now();
    staged_load_ = std::move(staged);
    LOG(INFO) << "staged the import of " << response.num_entries()
              << " state entries (step " << response.step_id()
              << ", transaction " << header.transaction_id() << ")";
    return response;
  }
  RETURN_IF_ERROR(Apply(staged));
  LOG(INFO) << "imported " << response.num_entries() << " state entries (step "
            << response.step_id() << ")";
  return response;
}

}  // namespace muond
