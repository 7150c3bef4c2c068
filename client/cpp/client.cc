#include "client/cpp/client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/view_util.h"
#include "core/common/error_reason.h"
#include "proto/status_details.h"

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
  if (options.client_id.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    options.client_id = absl::StrCat(host, ":", getpid());
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

// One unary RPC: the deadline, wait-for-ready and the job token on its
// context; the reply's status converted with its ErrorReason
// (proto/status_details.h), so callers branch on the reason, not the text.
template <typename Request, typename Response>
absl::StatusOr<Response> Client::Call(UnaryRpc<Request, Response> rpc,
                                      const Request& request,
                                      const RpcSettings& settings) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(settings.timeout));
  context.set_wait_for_ready(settings.wait_for_ready);
  if (!options_.token.empty()) {
    context.AddMetadata("x-muond-token", options_.token);
  }
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
  return Call(&Stub::RegisterParams, request, DefaultRpc());
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

absl::StatusOr<v1::StepResponse> Client::Step(
    int64_t step_id, const std::vector<v1::GroupOverride>& overrides) {
  v1::StepRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  request.set_step_id(step_id);
  for (const v1::GroupOverride& o : overrides) *request.add_overrides() = o;
  // A daemon that is gone must fail the step at once, not after the deadline.
  RpcSettings rpc = DefaultRpc();
  rpc.wait_for_ready = false;
  absl::StatusOr<v1::StepResponse> response = Call(&Stub::Step, request, rpc);
  // UNAVAILABLE without a reason is the transport's (our daemon is gone);
  // with PEER_GONE it is the daemon's report of a peer.
  if (absl::IsUnavailable(response.status()) &&
      !HasErrorReason(response.status(), ErrorReason::kPeerGone)) {
    return WithContext(response.status(), absl::StrCat("daemon at ", address_,
                                                       " is unreachable: "));
  }
  return response;
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

}  // namespace muond
