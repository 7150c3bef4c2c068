#include "client/cpp/client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/view_util.h"

namespace muond {
namespace {

absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      s.error_message());
}

size_t ElementSize(v1::DType dtype) { return dtype == v1::DTYPE_BF16 ? 2 : 4; }

}  // namespace

absl::StatusOr<int64_t> ViewSpanBytes(v1::DType dtype,
                                      const std::vector<int64_t>& shape,
                                      std::vector<int64_t>* strides) {
  if (shape.empty() || shape.size() > 2) {
    return absl::InvalidArgumentError("shape must be 1-D or 2-D");
  }
  if (strides->empty()) {
    *strides = shape.size() == 2 ? std::vector<int64_t>{shape[1], 1}
                                 : std::vector<int64_t>{1};
  }
  if (strides->size() != shape.size() || strides->back() != 1) {
    return absl::InvalidArgumentError(
        "strides must match shape and the innermost stride must be 1");
  }
  int64_t last = 0;  // element index of the last element
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] < 1)
      return absl::InvalidArgumentError("shape dims must be >= 1");
    last += (shape[d] - 1) * (*strides)[d];
  }
  return (last + 1) * int64_t(ElementSize(dtype));
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
  v1::TensorRef ref;
  ref.set_kind(v1::HOST_SHM);
  ref.set_shm_name(region.name());
  ref.set_byte_offset(static_cast<const char*>(ptr) -
                      static_cast<const char*>(region.data()));
  ref.set_dtype(dtype);
  for (int64_t d : shape) ref.add_shape(d);
  for (int64_t s : strides) ref.add_strides(s);
  return ref;
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

void Client::Prepare(grpc::ClientContext* context) const {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(options_.rpc_timeout));
  context->set_wait_for_ready(true);
  if (!options_.token.empty())
    context->AddMetadata("x-muond-token", options_.token);
}

absl::StatusOr<v1::RegisterParamsResponse> Client::Register(
    const std::vector<v1::ParamGroup>& groups) {
  v1::RegisterParamsRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  for (const v1::ParamGroup& g : groups) *request.add_groups() = g;
  v1::RegisterParamsResponse response;
  grpc::ClientContext context;
  Prepare(&context);
  absl::Status st =
      FromGrpcStatus(stub_->RegisterParams(&context, request, &response));
  if (!st.ok()) return st;
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

absl::StatusOr<v1::StepResponse> Client::Step(
    int64_t step_id, const std::vector<v1::GroupOverride>& overrides) {
  v1::StepRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  request.set_step_id(step_id);
  for (const v1::GroupOverride& o : overrides) *request.add_overrides() = o;
  v1::StepResponse response;
  grpc::ClientContext context;
  Prepare(&context);
  // A daemon that is gone must fail the step at once, not after the deadline.
  context.set_wait_for_ready(false);
  absl::Status st = FromGrpcStatus(stub_->Step(&context, request, &response));
  if (absl::IsUnavailable(st) &&
      st.message().find("peer daemon") == absl::string_view::npos) {
    return absl::UnavailableError(absl::StrCat(
        "daemon at ", address_, " is unreachable: ", st.message()));
  }
  if (!st.ok()) return st;
  return response;
}

absl::Status Client::Unregister() {
  v1::UnregisterParamsRequest request;
  request.set_job_id(options_.job_id);
  request.set_client_id(options_.client_id);
  v1::UnregisterParamsResponse response;
  grpc::ClientContext context;
  Prepare(&context);
  return FromGrpcStatus(stub_->UnregisterParams(&context, request, &response));
}

absl::StatusOr<v1::GetStatusResponse> Client::Status() {
  v1::GetStatusResponse response;
  grpc::ClientContext context;
  Prepare(&context);
  absl::Status st = FromGrpcStatus(
      stub_->GetStatus(&context, v1::GetStatusRequest(), &response));
  if (!st.ok()) return st;
  return response;
}

absl::StatusOr<v1::HealthResponse> Client::Health() {
  v1::HealthResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(5));
  if (!options_.token.empty())
    context.AddMetadata("x-muond-token", options_.token);
  absl::Status st =
      FromGrpcStatus(stub_->Health(&context, v1::HealthRequest(), &response));
  if (!st.ok()) return st;
  return response;
}

absl::StatusOr<v1::SaveStateResponse> Client::SaveState(
    const std::string& path) {
  v1::SaveStateRequest request;
  request.set_path(path);
  v1::SaveStateResponse response;
  grpc::ClientContext context;
  Prepare(&context);
  absl::Status st =
      FromGrpcStatus(stub_->SaveState(&context, request, &response));
  if (!st.ok()) return st;
  return response;
}

absl::StatusOr<v1::LoadStateResponse> Client::LoadState(
    const std::string& path) {
  v1::LoadStateRequest request;
  request.set_path(path);
  v1::LoadStateResponse response;
  grpc::ClientContext context;
  Prepare(&context);
  absl::Status st =
      FromGrpcStatus(stub_->LoadState(&context, request, &response));
  if (!st.ok()) return st;
  return response;
}

}  // namespace muond
