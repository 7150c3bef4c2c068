#pragma once
#include <atomic>
#include <string>
// The Coordinator gRPC service: a thin layer over CoordinatorCore (status
// conversion, stream plumbing, cancellation).
#include "muond/v1/muond.grpc.pb.h"
#include "server/coordinator/coordinator_core.h"

namespace muond {

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  // `core` is not owned and must outlive the service.
  // `token`: when non-empty every RPC must carry it in metadata
  // (server/common/auth.h); Join may carry it in JoinRequest.token instead.
  // `addresses_need_token`: ListDaemons lists daemon addresses only to a
  // caller that proved a token (the coordinator's, or the job's when it has
  // one); others get ranks and liveness. For an untokened coordinator other
  // hosts reach, where any caller may ask.
  explicit CoordinatorService(CoordinatorCore* core, std::string token = "",
                              bool addresses_need_token = false)
      : core_(core),
        token_(std::move(token)),
        addresses_need_token_(addresses_need_token) {}

  grpc::Status Join(grpc::ServerContext*, const v1::JoinRequest*,
                    v1::JoinResponse*) override;
  grpc::Status KvSet(grpc::ServerContext*, const v1::KvSetRequest*,
                     v1::KvSetResponse*) override;
  grpc::Status KvGet(grpc::ServerContext*, const v1::KvGetRequest*,
                     v1::KvGetResponse*) override;
  grpc::Status PublishManifest(grpc::ServerContext*,
                               const v1::PublishManifestRequest*,
                               v1::PublishManifestResponse*) override;
  // Sends the current plan (if any) and every later one until the client
  // cancels, and every registration round refused meanwhile as a
  // Plan{round_refused} (not a plan) and every newer communicator epoch as a
  // Plan{comm_epoch} (not a plan either); then marks the rank not live (it may
  // Join again).
  grpc::Status WatchPlans(grpc::ServerContext*, const v1::WatchPlansRequest*,
                          grpc::ServerWriter<v1::Plan>*) override;
  grpc::Status GetPlan(grpc::ServerContext*, const v1::GetPlanRequest*,
                       v1::Plan*) override;
  grpc::Status ReportTimings(grpc::ServerContext*,
                             const v1::ReportTimingsRequest*,
                             v1::ReportTimingsResponse*) override;
  grpc::Status Rebalance(grpc::ServerContext*, const v1::RebalanceRequest*,
                         v1::Plan*) override;
  grpc::Status ListDaemons(grpc::ServerContext*, const v1::ListDaemonsRequest*,
                           v1::ListDaemonsResponse*) override;
  // A daemon's failed communicators: the job's next communicator epoch,
  // pushed on every plan stream (CoordinatorCore::ReportCommFailure).
  grpc::Status ReportCommFailure(grpc::ServerContext*,
                                 const v1::ReportCommFailureRequest*,
                                 v1::ReportCommFailureResponse*) override;

  // Ends every WatchPlans stream (within its 200 ms poll), so that
  // grpc::Server::Shutdown does not wait for the daemons to hang up.
  void BeginShutdown() { shutting_down_.store(true); }

 private:
  // The one access check of every RPC but Join (which checks its tokens in
  // the core): the coordinator's token (Unauthenticated naming the metadata
  // keys, CheckToken), then the job's (PermissionDenied naming the job;
  // InvalidArgument for a job id CheckCoordinatorJobId refuses).
  grpc::Status Authorize(const grpc::ServerContext& context,
                         const std::string& job_id);

  // After Authorize: whether the caller proved a token (the coordinator's,
  // or the job's when it has one; a job without one proves nothing).
  bool CallerProvedAToken(const std::string& job_id);

  CoordinatorCore* core_;
  const std::string token_;
  const bool addresses_need_token_;
  std::atomic<bool> shutting_down_{false};
};

}  // namespace muond
