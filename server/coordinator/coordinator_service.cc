#include "server/coordinator/coordinator_service.h"

#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/grpc_status.h"

namespace muond {

grpc::Status CoordinatorService::Authorize(const grpc::ServerContext& context,
                                           const std::string& job_id) {
  // The coordinator's token first: a caller without it learns nothing about
  // which jobs exist. Then the job's own token (its first Join's).
  if (grpc::Status a = CheckToken(context, token_); !a.ok()) return a;
  return ToGrpc(core_->CheckJobToken(job_id, PresentedToken(context)));
}

grpc::Status CoordinatorService::Join(grpc::ServerContext* context,
                                      const v1::JoinRequest* request,
                                      v1::JoinResponse* response) {
  // The token may come in the request or, like every other RPC, in metadata.
  v1::JoinRequest join = *request;
  if (join.token().empty()) join.set_token(PresentedToken(*context));
  absl::StatusOr<v1::JoinResponse> r = core_->Join(join);
  if (!r.ok()) {
    LOG(WARNING) << "Join refused: " << r.status();
    return ToGrpc(r.status());
  }
  LOG(INFO) << "job " << request->job_id() << ": rank " << request->rank()
            << "/" << request->world_size() << " joined from "
            << request->host() << " (" << request->device() << ", "
            << request->address() << ")";
  *response = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::KvSet(grpc::ServerContext* context,
                                       const v1::KvSetRequest* request,
                                       v1::KvSetResponse*) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  return ToGrpc(core_->KvSet(*request));
}

grpc::Status CoordinatorService::KvGet(grpc::ServerContext* context,
                                       const v1::KvGetRequest* request,
                                       v1::KvGetResponse* response) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  absl::StatusOr<std::string> value =
      core_->KvGet(*request, [context] { return context->IsCancelled(); });
  if (!value.ok()) return ToGrpc(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::PublishManifest(
    grpc::ServerContext* context, const v1::PublishManifestRequest* request,
    v1::PublishManifestResponse*) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  std::string registration;
  auto it = context->client_metadata().find(kRegistrationMetadata);
  if (it != context->client_metadata().end()) {
    registration.assign(it->second.data(), it->second.size());
  }
  absl::StatusOr<int64_t> round_version =
      core_->PublishRegistration(*request, registration);
  if (!round_version.ok()) {
    LOG(WARNING) << "PublishManifest refused: " << round_version.status();
    return ToGrpc(round_version.status());
  }
  context->AddTrailingMetadata(kRoundPlanVersionMetadata,
                               std::to_string(*round_version));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::WatchPlans(
    grpc::ServerContext* context, const v1::WatchPlansRequest* request,
    grpc::ServerWriter<v1::Plan>* writer) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  // The open stream is what keeps a joined rank live (a Join alone holds
  // the rank only for the join grace).
  const bool counted = core_->StartWatching(request->job_id(), request->rank());
  int64_t sent = 0;
  int64_t refusals_seen = -1;  // refusals before the stream opened are old
  int64_t epoch_seen = 0;
  grpc::Status result = grpc::Status::OK;
  while (!context->IsCancelled() && !shutting_down_.load()) {
    absl::StatusOr<std::optional<v1::Plan>> plan = core_->WaitForWatcher(
        request->job_id(), request->rank(), sent, &refusals_seen,
        absl::Milliseconds(200), &epoch_seen);
    if (!plan.ok()) {
      result = ToGrpc(plan.status());
      break;
    }
    if (!plan->has_value()) continue;
    if (!writer->Write(**plan)) break;  // the daemon went away
    if (!(*plan)->round_refused().empty()) {
      LOG(INFO) << "job " << request->job_id()
                << ": round refusal sent to rank " << request->rank();
      continue;  // not a plan: `sent` counts plan versions
    }
    if ((*plan)->comm_epoch() > 0) continue;  // not a plan either
    sent = (*plan)->version();
    VLOG(1) << "job " << request->job_id() << ": plan version " << sent
            << " sent to rank " << request->rank();
  }
  if (counted) core_->Leave(request->job_id(), request->rank());
  LOG(INFO) << "job " << request->job_id() << ": rank " << request->rank()
            << " stopped watching plans";
  return result;
}

grpc::Status CoordinatorService::GetPlan(grpc::ServerContext* context,
                                         const v1::GetPlanRequest* request,
                                         v1::Plan* response) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  absl::StatusOr<v1::Plan> plan = core_->GetPlan(request->job_id());
  if (!plan.ok()) return ToGrpc(plan.status());
  *response = *std::move(plan);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ReportTimings(
    grpc::ServerContext* context, const v1::ReportTimingsRequest* request,
    v1::ReportTimingsResponse*) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  return ToGrpc(core_->ReportTimings(*request));
}

grpc::Status CoordinatorService::Rebalance(grpc::ServerContext* context,
                                           const v1::RebalanceRequest* request,
                                           v1::Plan* response) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  absl::StatusOr<v1::Plan> plan = core_->Rebalance(*request);
  if (!plan.ok()) return ToGrpc(plan.status());
  *response = *std::move(plan);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListDaemons(
    grpc::ServerContext* context, const v1::ListDaemonsRequest* request,
    v1::ListDaemonsResponse* response) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  absl::StatusOr<v1::ListDaemonsResponse> r = core_->ListDaemons(*request);
  if (!r.ok()) return ToGrpc(r.status());
  *response = *std::move(r);
  if (addresses_need_token_ && !CallerProvedAToken(request->job_id())) {
    // Addresses point a caller at the job's daemons: only for its members.
    for (v1::DaemonInfo& d : *response->mutable_daemons()) d.clear_address();
  }
  return grpc::Status::OK;
}

bool CoordinatorService::CallerProvedAToken(const std::string& job_id) {
  if (!token_.empty()) return true;  // Authorize checked it
  // The job's token, when it has one, was checked by Authorize as well: an
  // empty token fails exactly when there is one.
  return !core_->CheckJobToken(job_id, "").ok();
}

grpc::Status CoordinatorService::ReportCommFailure(
    grpc::ServerContext* context, const v1::ReportCommFailureRequest* request,
    v1::ReportCommFailureResponse* response) {
  if (grpc::Status denied = Authorize(*context, request->job_id());
      !denied.ok()) {
    return denied;
  }
  absl::StatusOr<v1::ReportCommFailureResponse> r =
      core_->ReportCommFailure(*request);
  if (!r.ok()) return ToGrpc(r.status());
  *response = *std::move(r);
  return grpc::Status::OK;
}

}  // namespace muond
