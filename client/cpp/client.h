#pragma once
// muond::Client: the trainer side of the Optimizer service
// (docs/ARCHITECTURE.md "Processes").
//
//   ASSIGN_OR_RETURN(auto region, ShmRegion::Create("/muond-job-r0", bytes));
//   float* w = static_cast<float*>(*region->Allocate(rows * cols * 4));
//   ...
//   ASSIGN_OR_RETURN(auto client,
//                    Client::Connect("unix:///tmp/muond-job-0.sock",
//                                    {.job_id = "job"}));
//   v1::Param p = MakeParam("w", {P, Q}, *HostRef(*region, w, ...), ...);
//   // Each v1::ParamGroup: name, algorithm, hyperparameters, params and a
//   // domain: a name (e.g. "dense"), gtp_size and tp_size (1 = no such axis).
//   client->Register({HostRegion(*region)}, groups);
//   client->WaitForPlan(absl::Seconds(30));
//   for (step ...) { backward(); client->Step(step_id); }
//
// (ASSIGN_OR_RETURN stands for the trainer's own StatusOr handling: the
// project's macro, core/common/status_macros.h, is not visible to clients.)
//
// Step fails fast (no wait-for-ready): UNAVAILABLE naming the address when
// the daemon is gone, or the daemon's UNAVAILABLE naming a dead peer rank,
// which carries ErrorReason::kPeerGone (core/common/error_reason.h):
//   if (HasErrorReason(st, ErrorReason::kPeerGone)) { restart the job }
// An UNAVAILABLE without a reason (this trainer's own daemon is unreachable)
// also means: restart the job's daemons. Every method's error keeps the
// daemon's code, message and ErrorReason.
//
// Contract of Step: the gradients are complete when it is called (the
// trainer's CUDA stream synchronised); the updated params are visible to the
// trainer when it returns. A trainer whose own checks refuse a step calls
// RefuseStep(step_id, why) instead, so its peers' Step fails at once
// (FailedPrecondition with ErrorReason::kTrainerRefused, metadata "ranks").
//
// The step channel (docs/ARCHITECTURE.md "The step channel";
// client/cpp/step_channel.h): after each successful Register the client
// opens one to its daemon (ClientOptions.step_channel), and Step and
// RefuseStep go through shared memory and a futex instead of a gRPC call
// (a futex wake-up of ~0.01-0.1 ms instead of gRPC's ~0.7-1 ms after an idle
// gap: 0.5-0.7 ms less a step on a CPU host,
// bench/results/step_channel_cpu.md), with the same answers and errors. Where
// none can be had (an older daemon, another host's /dev/shm,
// --max_step_channels reached or 0) steps use the Step RPC, as they do for a
// request or answer too large for the channel, from another thread while one
// step is in the channel, and for good once a step's outcome was unknown (the
// deadline passed, or the daemon died mid-step: Unavailable naming the address
// within ~0.5 s, not at rpc_timeout). HasStepChannel() and StepChannelStatus()
// tell which way steps go. A forked child must not use its parent's Client (its
// copy of the channel is let go at the fork); destroying the copy is safe: its
// gRPC channel is left to the child's exit (destroying it would wait forever
// for gRPC's threads, which are the parent's).
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/cpp/shm_region.h"
#include "client/cpp/step_channel.h"
#include "muond/v1/muond.grpc.pb.h"

namespace muond {

struct ClientOptions {
  std::string job_id;
  // Identifies this trainer to the daemon (ownership of its params); default
  // "<hostname>:<pid>".
  std::string client_id;
  // Deadline of each unary RPC (Step included).
  absl::Duration rpc_timeout = absl::Minutes(5);
  // Shared job token for a daemon on TCP (sent as 'x-muond-token').
  std::string token;
  // PEM root certificate: connect with TLS (daemon started with --tls_cert).
  std::string tls_root_cert_pem;
  // Send Step and RefuseStep through a step channel (above) when the daemon
  // takes one; false: always the Step RPC.
  bool step_channel = true;
  // The channel's request and response areas in bytes: multiples of 4096 in
  // [64 KiB, 64 MiB]; 0: sized for the registered groups
  // (StepChannelCapacitiesFor, room for a refusal of kMaxChannelRefusalBytes).
  // A larger request goes over the Step RPC; a larger answer is fetched
  // over it (the daemon keeps it for the same request; an older daemon
  // answers from its record of the step).
  uint32_t step_channel_request_bytes = 0;
  uint32_t step_channel_response_bytes = 0;
  // How long before a step's answer is due (the last step's wait) the
  // trainer polls for it instead of sleeping, and as long after
  // (StepChannel::set_answer_poll; at most 100 ms counts): a trainer asleep
  // through a GPU step wakes ~0.05-0.1 ms after the answer. Unset: 1 ms when
  // a registered region is CUDA memory (the daemon steps on the GPU), else
  // zero (a host daemon's step needs the cores).
  std::optional<absl::Duration> step_channel_poll;
};

// The RefuseStep reason a step channel sized for the groups has room for
// (longer ones go over the Step RPC); as the Python client's.
inline constexpr size_t kMaxChannelRefusalBytes = 16 << 10;

// Memory is registered as regions (docs/ARCHITECTURE.md "Memory
// registration"): Register declares each region once, and every TensorRef
// names its region plus a byte offset, dtype, shape and strides.

// The region declaration of a whole shm object: kind MEMORY_KIND_HOST_SHM,
// named after the object (its shm name), byte_size its size.
v1::MemoryRegion HostRegion(const ShmRegion& region);

// A TensorRef into HostRegion(region) for `shape`/`strides` (elements;
// innermost stride 1; empty strides = row-major contiguous) at `ptr`.
// InvalidArgument when the view does not lie inside the region.
absl::StatusOr<v1::TensorRef> HostRef(const ShmRegion& region, const void* ptr,
                                      v1::DType dtype,
                                      std::vector<int64_t> shape,
                                      std::vector<int64_t> strides = {});

// A CUDA allocation shared by IPC (client/cpp/cuda_ref.cc).
struct CudaAllocation {
  const void* base = nullptr;  // device pointer to the allocation's start
  // Kind MEMORY_KIND_CUDA_IPC: the allocation's IPC handle, byte_size (all of
  // it) and device ordinal, under the name given to CudaRegion.
  v1::MemoryRegion region;
};

// The allocation that contains device pointer `ptr`, as region `name`.
// Unavailable when run without the CUDA driver or when the allocation cannot
// be shared by IPC (pool or cuMemCreate memory); InvalidArgument when `ptr`
// is not in a CUDA allocation. The calling thread must have the device's
// context current.
absl::StatusOr<CudaAllocation> CudaRegion(const void* ptr, std::string name);

// A TensorRef into `allocation`'s region for a view at device pointer `ptr`.
// InvalidArgument when the view does not lie inside the allocation.
absl::StatusOr<v1::TensorRef> CudaRef(const CudaAllocation& allocation,
                                      const void* ptr, v1::DType dtype,
                                      std::vector<int64_t> shape,
                                      std::vector<int64_t> strides = {});

// A param entry for a group.
v1::Param MakeParam(const std::string& name, std::vector<int64_t> full_shape,
                    v1::TensorRef param, v1::TensorRef grad,
                    const v1::ShardTags& tags = {});

// A rank's optimizer state as ExportState / ImportState carry it (proto
// StateChunk): entry ("<param>.momentum", "<param>.exp_avg", ...) -> fp32
// values of this rank's shard, and the step id it is the result of.
struct OptimizerState {
  int64_t step_id = -1;
  std::map<std::string, std::vector<float>> entries;
};

class Client {
 public:
  // Connects to a daemon ("unix:///path" or "host:port"). Does not wait for
  // it to be up; the first RPC does (with the RPC timeout).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      const std::string& address, ClientOptions options);

  // Registers `groups`, whose TensorRefs lie in `regions`, all or nothing.
  absl::StatusOr<v1::RegisterParamsResponse> Register(
      const std::vector<v1::MemoryRegion>& regions,
      const std::vector<v1::ParamGroup>& groups);
  // Polls Health until the daemon has a plan and its step engine, or times
  // out with DeadlineExceeded; FailedPrecondition with the daemon's reason as
  // soon as building the step engine failed (Health.engine_error: the daemon
  // waits for a new plan, so waiting on is pointless).
  absl::Status WaitForPlan(absl::Duration timeout);
  // InvalidArgument for an override whose group is not valid UTF-8 (no
  // group's name): the step is refused for the job too (RefuseStep).
  absl::StatusOr<v1::StepResponse> Step(
      int64_t step_id, const std::vector<v1::GroupOverride>& overrides = {});
  // Step `step_id` refused by this trainer's own checks (`why` names the
  // param and the rule; StepRequest.trainer_refusal): the job votes on it, so
  // every rank's step fails at once instead of its peers waiting for the
  // communicator timeout, and nothing is applied. Returns the daemon's answer
  // (FailedPrecondition: the refusal); InvalidArgument for an empty `why`.
  // Bytes of `why` that are not UTF-8 travel escaped (\xNN).
  absl::Status RefuseStep(int64_t step_id, std::string_view why);
  absl::Status Unregister();
  absl::StatusOr<v1::GetStatusResponse> Status();
  absl::StatusOr<v1::HealthResponse> Health();
  absl::StatusOr<v1::SaveStateResponse> SaveState(const std::string& path);
  absl::StatusOr<v1::LoadStateResponse> LoadState(const std::string& path);

  // The state of this trainer's params on its daemon, streamed in chunks of
  // at most `max_chunk_bytes` (0: the daemon's 1 MiB), so any size fits
  // gRPC's message limit.
  absl::StatusOr<OptimizerState> ExportState(int64_t max_chunk_bytes = 0);
  // Sends `state` back, all or nothing (the daemon checks every entry before
  // it changes anything); the next step id is state.step_id + 1. With a
  // `transaction_id` it is only staged, applied by CommitState and dropped
  // by AbortState.
  absl::StatusOr<v1::ImportStateResponse> ImportState(
      const OptimizerState& state, const std::string& transaction_id = "",
      int64_t max_chunk_bytes = 0);
  absl::StatusOr<v1::LoadStateResponse> CommitState(
      const std::string& transaction_id);
  absl::StatusOr<v1::LoadStateResponse> AbortState(
      const std::string& transaction_id);

  // Step and RefuseStep go through a step channel now (else the Step RPC).
  bool HasStepChannel() const { return has_channel_.load(); }
  // OK while a channel is open; else why not: FailedPrecondition when
  // ClientOptions.step_channel is off or nothing was registered yet, the
  // daemon's refusal of OpenStepChannel (e.g. Unimplemented, an older
  // daemon), a local shm error, or why the channel was dropped. Waits for a
  // step in the channel.
  absl::Status StepChannelStatus() const;
  // Polls for an answer the open step channel ran
  // (ClientOptions.step_channel_poll); 0 without a channel. Waits for a step
  // in the channel.
  int64_t StepChannelAnswerPolls() const;

  const ClientOptions& options() const { return options_; }
  v1::Optimizer::Stub* stub() { return stub_.get(); }

  // Closes the step channel (the daemon told, the shm object unmapped).
  ~Client();

 private:
  // A StepRequest of this client's job and id for `step_id`.
  v1::StepRequest StepRequestOf(int64_t step_id) const;
  // Through the step channel when one is open, else the Step RPC; a
  // transport UNAVAILABLE names the address.
  absl::StatusOr<v1::StepResponse> SendStep(const v1::StepRequest& request);
  // The Step RPC without wait-for-ready.
  absl::StatusOr<v1::StepResponse> CallStep(const v1::StepRequest& request);
  // The channel's answer, or nullopt when the request was not sent there.
  std::optional<absl::StatusOr<v1::StepResponse>> StepThroughChannel(
      const v1::StepRequest& request);
  // The answer to a request the daemon answered through the channel but
  // whose answer did not fit it: the same request over the Step RPC, which
  // returns that answer where the daemon `answers_kept` it.
  absl::StatusOr<v1::StepResponse> FetchAnswerOverGrpc(
      const v1::StepRequest& request, bool answers_kept);
  // A channel of the daemon's for steps of `groups`, replacing any open one;
  // it polls for answers for `answer_poll` (StepChannel::set_answer_poll).
  void OpenStepChannel(const std::vector<v1::ParamGroup>& groups,
                       absl::Duration answer_poll);
  absl::StatusOr<std::unique_ptr<StepChannel>> NewStepChannel(
      const std::vector<v1::ParamGroup>& groups);
  // Closes the channel; `why` is StepChannelStatus() from now on.
  void DropStepChannel(absl::Status why);
  // A unary method of the stub, e.g. &v1::Optimizer::Stub::Step.
  template <typename Request, typename Response>
  using UnaryRpc = grpc::Status (v1::Optimizer::Stub::*)(grpc::ClientContext*,
                                                         const Request&,
                                                         Response*);
  struct RpcSettings {
    absl::Duration timeout;  // the RPC's deadline, from now
    bool wait_for_ready;     // wait for the daemon to come up (until then)
  };

  Client(std::unique_ptr<v1::Optimizer::Stub> stub, ClientOptions options)
      : stub_(std::move(stub)),
        options_(std::move(options)),
        creator_pid_(getpid()) {}
  RpcSettings DefaultRpc() const {
    return {.timeout = options_.rpc_timeout, .wait_for_ready = true};
  }
  // The deadline, wait-for-ready and the job token on a call's context.
  void Prepare(grpc::ClientContext* context, const RpcSettings& settings) const;
  v1::StateHeader StateHeaderFor(int64_t step_id,
                                 const std::string& transaction_id,
                                 int64_t max_chunk_bytes) const;
  absl::StatusOr<v1::LoadStateResponse> EndStateTransaction(
      v1::StatePhase phase, const std::string& transaction_id);
  template <typename Request, typename Response>
  absl::StatusOr<Response> Call(UnaryRpc<Request, Response> rpc,
                                const Request& request,
                                const RpcSettings& settings);

  std::unique_ptr<v1::Optimizer::Stub> stub_;
  ClientOptions options_;
  const pid_t creator_pid_;  // a forked child's copy has another pid
  std::string address_;
  // One step in the channel at a time; guards channel_ and channel_status_.
  // A Step finding it held (another thread's step) uses the Step RPC.
  mutable std::mutex channel_mu_;
  std::unique_ptr<StepChannel> channel_;
  absl::Status channel_status_ =
      absl::FailedPreconditionError("no step channel: nothing registered yet");
  std::atomic<bool> has_channel_{false};
};

}  // namespace muond
