#include "client/cpp/client.h"

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/step_channel.h"
#include "client/cpp/utf8.h"
#include "client/cpp/view_util.h"
#include "core/common/error_reason.h"
#include "proto/status_details.h"
#include "proto/step_channel_layout.h"

namespace muond {
namespace {

using Stub = v1::Optimizer::Stub;

}  // namespace

v1::MemoryRegion HostRegion(const ShmRegion& region) {
  v1::MemoryRegion declaration;
  declaration.set_name(region.name());
  declaration.set_kind(v1::MEMORY_KIND_HOST_SHM);
  declaration.set_shm_name(region.name());
  declaration.set_byte_size(region.size());
  return declaration;
}

absl::StatusOr<v1::TensorRef> HostRef(const ShmRegion& region, const void* ptr,
                                      v1::DType dtype,
                                      std::vector<int64_t> shape,
                                      std::vector<int64_t> strides) {
  absl::StatusOr<int64_t> span = ViewSpanBytes(dtype, shape, &strides);
  if (!span.ok()) return span.status();
  if (!region.Contains(ptr, size_t(*span))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "view of ", *span, " bytes does not lie inside shm object '",
        region.name(), "' (", region.size(), " bytes)"));
  }
  return MakeTensorRef(
      region.name(),
      static_cast<const char*>(ptr) - static_cast<const char*>(region.data()),
      dtype, shape, strides);
}

v1::Param MakeParam(const std::string& name, std::vector<int64_t> full_shape,
                    v1::TensorRef param, v1::TensorRef grad,
                    const v1::ShardTags& tags) {
  v1::Param p;
  p.set_name(name);
  for (int64_t d : full_shape) p.add_full_shape(d);
  *p.mutable_param() = std::move(param);
  *p.mutable_grad() = std::move(grad);
  *p.mutable_tags() = tags;
  return p;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(
    const std::string& address, ClientOptions options) {
  if (options.job_id.empty()) {
    return absl::InvalidArgumentError("ClientOptions.job_id must be set");
  }
  for (auto [field, bytes] :
       {std::pair{"ClientOptions.step_channel_request_bytes",
                  options.step_channel_request_bytes},
        std::pair{"ClientOptions.step_channel_response_bytes",
                  options.step_channel_response_bytes}}) {
    if (bytes == 0) continue;
    if (absl::Status st = CheckStepChannelCapacity(field, bytes); !st.ok()) {
      return st;
    }
  }
  if (options.client_id.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    options.client_id = absl::StrCat(host, ":", getpid());
  }
  // Proto strings of every request: malformed UTF-8 would not parse there.
  for (auto [field, text] :
       {std::pair{"ClientOptions.job_id", &options.job_id},
        std::pair{"ClientOptions.client_id", &options.client_id}}) {
    if (!IsValidUtf8(*text)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " '", ToValidUtf8(*text),
                       "' must be valid UTF-8 (a proto string)"));
    }
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!options.tls_root_cert_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options.tls_root_cert_pem;
    credentials = grpc::SslCredentials(ssl);
  }
  auto channel = grpc::CreateCustomChannel(address, credentials, args);
  auto client = std::unique_ptr<Client>(
      new Client(v1::Optimizer::NewStub(channel), std::move(options)));
  client->address_ = address;
  return client;
}

void Client::Prepare(grpc::ClientContext* context,
                     const RpcSettings& settings) const {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(settings.timeout));
  context->set_wait_for_ready(settings.wait_for_ready);
  if (!options_.token.empty()) {
    context->AddMetadata("x-muond-token", options_.token);
  }
}

namespace {

// ClientOptions.step_channel_poll, or its default for these regions: 1 ms
// where the daemon steps on the GPU (a region of CUDA memory), else none.
absl::Duration AnswerPoll(const ClientOptions& options,
                          const std::vector<v1::MemoryRegion>& regions) {
  if (options.step_channel_poll.has_value()) return *options.step_channel_poll;
  for (const v1::MemoryRegion& r : regions) {
    if (r.kind() == v1::MEMORY_KIND_CUDA_IPC) return absl::Milliseconds(1);
  }
  return absl::ZeroDuration();
}

}  // namespace

// One unary RPC: the deadline, wait-for-ready and the job token on its
// context; the reply's status converted with its ErrorReason
// (proto/status_details.h), so callers branch on the reason, not the text.
template <typename Request, typename Response>
absl::StatusOr<Response> Client::Call(UnaryRpc<Request, Response> rpc,
                                      const Request& request,
                                      const RpcSettings& settings) {
  grpc::ClientContext context;
  Prepare(&context, settings);
  Response response;
  absl::Status st =
      FromGrpcStatus((stub_.get()->*rpc)(&context, request, &response));
  if (!st.ok()) return st;
  return response;
}

absl::StatusOr<v1::RegisterParamsResponse> Client::Register(
    const std::vector<v1::MemoryRegion>& regions,
    const std::vector<v1::ParamGroup>& groups) {
  v1::RegisterParamsRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  for (const v1::MemoryRegion& r : regions) *request.add_regions() = r;
  for (const v1::ParamGroup& g : groups) *request.add_groups() = g;
  absl::StatusOr<v1::RegisterParamsResponse> response =
      Call(&Stub::RegisterParams, request, DefaultRpc());
  if (response.ok()) OpenStepChannel(groups, AnswerPoll(options_, regions));
  return response;
}

absl::Status Client::WaitForPlan(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    absl::StatusOr<v1::HealthResponse> health = Health();
    if (health.ok() && health->has_plan()) return absl::OkStatus();
    if (health.ok() && !health->engine_error().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("daemon has no step engine: ", health->engine_error()));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "daemon has no plan after ", absl::FormatDuration(timeout),
          health.ok() ? ""
                      : absl::StrCat(" (", health.status().ToString(), ")")));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

v1::StepRequest Client::StepRequestOf(int64_t step_id) const {
  v1::StepRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  request.set_step_id(step_id);
  return request;
}

absl::StatusOr<v1::StepResponse> Client::CallStep(
    const v1::StepRequest& request) {
  // A daemon that is gone must fail the step at once, not after the deadline.
  RpcSettings rpc = DefaultRpc();
  rpc.wait_for_ready = false;
  return Call(&Stub::Step, request, rpc);
}

absl::StatusOr<v1::StepResponse> Client::SendStep(
    const v1::StepRequest& request) {
  std::optional<absl::StatusOr<v1::StepResponse>> through =
      StepThroughChannel(request);
  absl::StatusOr<v1::StepResponse> response =
      through.has_value() ? *std::move(through) : CallStep(request);
  // UNAVAILABLE without a reason is the transport's (our daemon is gone);
  // with PEER_GONE it is the daemon's report of a peer.
  if (absl::IsUnavailable(response.status()) &&
      !HasErrorReason(response.status(), ErrorReason::kPeerGone)) {
    return WithContext(response.status(), absl::StrCat("daemon at ", address_,
                                                       " is unreachable: "));
  }
  return response;
}

std::optional<absl::StatusOr<v1::StepResponse>> Client::StepThroughChannel(
    const v1::StepRequest& request) {
  std::unique_lock<std::mutex> lock(channel_mu_, std::try_to_lock);
  if (!lock.owns_lock() || channel_ == nullptr) return std::nullopt;
  StepChannel::Reply reply =
      channel_->Step(request, absl::Now() + options_.rpc_timeout);
  const bool answers_kept = channel_->answers_kept();
  if (!channel_->usable()) {
    DropStepChannel(absl::UnavailableError(absl::StrCat(
        "the step channel was dropped: ", channel_->WhyUnusable())));
  }
  switch (reply.outcome) {
    case StepChannel::Outcome::kNotSent:
      return std::nullopt;
    case StepChannel::Outcome::kTooLarge:
      return FetchAnswerOverGrpc(request, answers_kept);
    case StepChannel::Outcome::kAnswered:
    case StepChannel::Outcome::kFailed:
      break;
  }
  return std::move(reply.answer);
}

absl::StatusOr<v1::StepResponse> Client::FetchAnswerOverGrpc(
    const v1::StepRequest& request, bool answers_kept) {
  absl::StatusOr<v1::StepResponse> response = CallStep(request);
  // A daemon that keeps the answer returns it as it was. An older one
  // answers from its record of this very request, which it answered through
  // the channel: no other process's step, so no replay to the caller.
  if (response.ok() && !answers_kept) response->set_replayed(false);
  return response;
}

void Client::OpenStepChannel(const std::vector<v1::ParamGroup>& groups,
                             absl::Duration answer_poll) {
  std::lock_guard<std::mutex> lock(channel_mu_);
  DropStepChannel(absl::OkStatus());  // replaced: sized for these groups
  absl::StatusOr<std::unique_ptr<StepChannel>> channel =
      options_.step_channel
          ? NewStepChannel(groups)
          : absl::FailedPreconditionError(
                "no step channel: ClientOptions.step_channel is false");
  // A refusal is no error of the trainer's: its steps use the Step RPC.
  channel_status_ = channel.status();
  if (!channel.ok()) return;
  channel_ = *std::move(channel);
  channel_->set_answer_poll(answer_poll);
  has_channel_.store(true);
}

absl::StatusOr<std::unique_ptr<StepChannel>> Client::NewStepChannel(
    const std::vector<v1::ParamGroup>& groups) {
  StepChannelCapacities capacities =
      StepChannelCapacitiesFor(groups, kMaxChannelRefusalBytes);
  if (options_.step_channel_request_bytes != 0) {
    capacities.request = options_.step_channel_request_bytes;
  }
  if (options_.step_channel_response_bytes != 0) {
    capacities.response = options_.step_channel_response_bytes;
  }
  const std::string name = StepChannelShmName(options_.job_id);
  absl::StatusOr<std::unique_ptr<StepChannel>> channel =
      StepChannel::Create(name, capacities);
  if (!channel.ok()) return channel.status();
  v1::OpenStepChannelRequest request;
  request.set_shm_name(name);
  absl::StatusOr<v1::OpenStepChannelResponse> opened =
      Call(&Stub::OpenStepChannel, request, DefaultRpc());
  // The daemon keeps its own descriptor; no name is left behind either way.
  shm_unlink(name.c_str());
  if (!opened.ok()) return opened.status();
  if (opened->version() != step_channel::kVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon speaks step channel layout version ", opened->version(),
        ", this client ", step_channel::kVersion));
  }
  (*channel)->MarkOpenedByDaemon(opened->answers_kept());
  return channel;
}

void Client::DropStepChannel(absl::Status why) {
  has_channel_.store(false);
  channel_.reset();
  channel_status_ = std::move(why);
}

absl::Status Client::StepChannelStatus() const {
  std::lock_guard<std::mutex> lock(channel_mu_);
  return channel_status_;
}

int64_t Client::StepChannelAnswerPolls() const {
  std::lock_guard<std::mutex> lock(channel_mu_);
  return channel_ != nullptr ? channel_->answer_polls() : 0;
}

// No lock: no other thread may use a Client being destroyed (and a forked
// child's copy of the mutex may be held by a thread the child lacks).
Client::~Client() {
  channel_.reset();
  // A forked child's copy: gRPC's threads live only in the parent, and
  // destroying the channel waits for them (forever). Left to the exit.
  if (getpid() != creator_pid_) (void)stub_.release();
}

absl::StatusOr<v1::StepResponse> Client::Step(
    int64_t step_id, const std::vector<v1::GroupOverride>& overrides) {
  for (const v1::GroupOverride& o : overrides) {
    if (IsValidUtf8(o.group())) continue;
    // Not sendable (the daemon could not parse it) and no registered
    // group's name: refused here, and the job told (RefuseStep), so that
    // the other ranks' steps fail at once instead of at their comm timeout.
    const std::string why =
        absl::StrCat("overrides: group '", ToValidUtf8(o.group()),
                     "' is not valid UTF-8, so no registered group's name");
    (void)RefuseStep(step_id, why);
    return absl::InvalidArgumentError(why);
  }
  v1::StepRequest request = StepRequestOf(step_id);
  for (const v1::GroupOverride& o : overrides) *request.add_overrides() = o;
  return SendStep(request);
}

absl::Status Client::RefuseStep(int64_t step_id, std::string_view why) {
  if (why.empty()) {
    return absl::InvalidArgumentError(
        "RefuseStep: the reason is empty (an empty one would be a step)");
  }
  v1::StepRequest request = StepRequestOf(step_id);
  // A proto string: malformed bytes (say, of a param's name) are escaped
  // rather than making the refusal unsendable.
  request.set_trainer_refusal(ToValidUtf8(why));
  return SendStep(request).status();
}

absl::Status Client::Unregister() {
  v1::UnregisterParamsRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  return Call(&Stub::UnregisterParams, request, DefaultRpc()).status();
}

absl::StatusOr<v1::GetStatusResponse> Client::Status() {
  return Call(&Stub::GetStatus, v1::GetStatusRequest(), DefaultRpc());
}

absl::StatusOr<v1::HealthResponse> Client::Health() {
  // A short deadline and no wait-for-ready: a probe, polled by WaitForPlan.
  return Call(&Stub::Health, v1::HealthRequest(),
              {.timeout = absl::Seconds(5), .wait_for_ready = false});
}

absl::StatusOr<v1::SaveStateResponse> Client::SaveState(
    const std::string& path) {
  v1::SaveStateRequest request;
  request.set_path(path);
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  return Call(&Stub::SaveState, request, DefaultRpc());
}

absl::StatusOr<v1::LoadStateResponse> Client::LoadState(
    const std::string& path) {
  v1::LoadStateRequest request;
  request.set_path(path);
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  return Call(&Stub::LoadState, request, DefaultRpc());
}

v1::StateHeader Client::StateHeaderFor(int64_t step_id,
                                       const std::string& transaction_id,
                                       int64_t max_chunk_bytes) const {
  v1::StateHeader header;
  header.set_job_id(options_.job_id);
  header.set_client_id(options_.client_id);
  header.set_step_id(step_id);
  header.set_transaction_id(transaction_id);
  header.set_max_chunk_bytes(max_chunk_bytes);
  return header;
}

absl::StatusOr<OptimizerState> Client::ExportState(int64_t max_chunk_bytes) {
  v1::ExportStateRequest request;
  *request.mutable_header() = StateHeaderFor(-1, "", max_chunk_bytes);
  grpc::ClientContext context;
  Prepare(&context, DefaultRpc());
  std::unique_ptr<grpc::ClientReader<v1::StateChunk>> reader =
      stub_->ExportState(&context, request);
  OptimizerState state;
  v1::StateChunk chunk;
  absl::Status bad;
  bool header_seen = false;
  while (bad.ok() && reader->Read(&chunk)) {
    if (chunk.has_header()) {
      state.step_id = chunk.header().step_id();
      header_seen = true;
      continue;
    }
    std::vector<float>& values = state.entries[chunk.entry()];
    // The daemon sends each entry's chunks in order, without gaps.
    if (chunk.offset() != int64_t(values.size()) ||
        chunk.data().size() % sizeof(float) != 0) {
      bad = absl::DataLossError(
          absl::StrCat("ExportState: entry '", chunk.entry(),
                       "' arrived out of order at offset ", chunk.offset()));
      break;
    }
    if (values.empty()) values.reserve(size_t(chunk.numel()));
    const float* data = reinterpret_cast<const float*>(chunk.data().data());
    values.insert(values.end(), data,
                  data + chunk.data().size() / sizeof(float));
  }
  if (!bad.ok()) context.TryCancel();
  absl::Status st = FromGrpcStatus(reader->Finish());
  if (!bad.ok()) return bad;
  if (!st.ok()) return st;
  if (!header_seen) {
    return absl::DataLossError("ExportState: the stream carried no header");
  }
  return state;
}

absl::StatusOr<v1::ImportStateResponse> Client::ImportState(
    const OptimizerState& state, const std::string& transaction_id,
    int64_t max_chunk_bytes) {
  const int64_t chunk_values =
      (max_chunk_bytes > 0 ? max_chunk_bytes : int64_t{1} << 20) /
      int64_t(sizeof(float));
  if (chunk_values < 1) {
    return absl::InvalidArgumentError("max_chunk_bytes: at least 4");
  }
  grpc::ClientContext context;
  Prepare(&context, DefaultRpc());
  v1::ImportStateResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::StateChunk>> writer =
      stub_->ImportState(&context, &response);
  v1::StateChunk chunk;
  *chunk.mutable_header() = StateHeaderFor(state.step_id, transaction_id, 0);
  chunk.mutable_header()->set_num_entries(int64_t(state.entries.size()));
  bool open = writer->Write(chunk);
  chunk.clear_header();
  for (auto it = state.entries.begin(); open && it != state.entries.end();
       ++it) {
    const std::vector<float>& values = it->second;
    chunk.set_entry(it->first);
    chunk.set_numel(int64_t(values.size()));
    int64_t offset = 0;
    do {
      const int64_t n = std::min(chunk_values, int64_t(values.size()) - offset);
      chunk.set_offset(offset);
      chunk.set_data(reinterpret_cast<const char*>(values.data() + offset),
                     size_t(n) * sizeof(float));
      open = writer->Write(chunk);
      offset += n;
    } while (open && offset < int64_t(values.size()));
  }
  // A refusal ends the stream early; Finish carries the daemon's reason.
  writer->WritesDone();
  absl::Status st = FromGrpcStatus(writer->Finish());
  if (!st.ok()) return st;
  return response;
}

absl::StatusOr<v1::LoadStateResponse> Client::EndStateTransaction(
    v1::StatePhase phase, const std::string& transaction_id) {
  v1::LoadStateRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  request.set_phase(phase);
  request.set_transaction_id(transaction_id);
  return Call(&Stub::LoadState, request, DefaultRpc());
}

absl::StatusOr<v1::LoadStateResponse> Client::CommitState(
    const std::string& transaction_id) {
  return EndStateTransaction(v1::STATE_PHASE_COMMIT, transaction_id);
}

absl::StatusOr<v1::LoadStateResponse> Client::AbortState(
    const std::string& transaction_id) {
  return EndStateTransaction(v1::STATE_PHASE_ABORT, transaction_id);
}

}  // namespace muond
