#pragma once
// The daemon's side of the Coordinator service over gRPC: Join (retried
// until the coordinator answers), the manifest, a background WatchPlans
// stream that re-joins and re-subscribes when the coordinator goes away and
// comes back (the daemon keeps its plans meanwhile) and also carries the
// job's communicator epoch, failed communicators reported, fire-and-forget
// timing reports, and a KeyValueStore over KvSet/KvGet for communicator
// rendezvous.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "core/comm/kv_store.h"
#include "muond/v1/muond.grpc.pb.h"
#include "server/daemon/daemon_core.h"

namespace muond {

class GrpcCoordinatorLink : public CoordinatorLink, public KeyValueStore {
 public:
  // `join` carries job, rank, world size, host, device, address and token.
  // Every call carries join.token() in metadata as well.
  GrpcCoordinatorLink(const std::string& address, v1::JoinRequest join,
                      std::shared_ptr<grpc::ChannelCredentials> credentials =
                          grpc::InsecureChannelCredentials());
  // Stop().
  ~GrpcCoordinatorLink() override;

  // Joins and starts the plan watcher. Refusals that pass by themselves are
  // retried until `deadline`, each logged once: the coordinator unreachable,
  // the rank still live, the job held by live daemons of another world size
  // or token, max_jobs full; then the last refusal is returned (Unavailable
  // naming the address for an unreachable coordinator). No Join attempt
  // outlasts `deadline`. Once `cancelled` (may be empty) returns true the
  // retries stop: Cancelled quoting the last refusal. The plan watcher
  // calls `on_plan` for every plan, and for a refusal of a registration
  // round (a Plan with round_refused) that dropped this daemon's latest
  // registration.
  absl::Status Start(std::function<void(const v1::Plan&)> on_plan,
                     absl::Time deadline,
                     const std::function<bool()>& cancelled = {});
  // Start until `timeout` from now.
  absl::Status Start(std::function<void(const v1::Plan&)> on_plan,
                     absl::Duration timeout);
  // Ends and joins the watcher and reporter threads, so `on_plan` is never
  // called again (call it before its target goes away). The store (Set,
  // Get) and the other calls keep working: an abandoned engine build that
  // shares this link may still use it.
  void Stop();

  absl::Status PublishManifest(
      const v1::PublishManifestRequest& manifest) override;
  // Sends a new registration id (metadata), kept for re-publishing after a
  // coordinator restart; returns the coordinator's round plan version.
  absl::StatusOr<int64_t> PublishRegistration(
      const v1::PublishManifestRequest& manifest) override;
  // An empty manifest with registration_refused = `reason`, under no
  // registration id (this daemon has no registration to be refused).
  absl::Status PublishRefusal(const std::string& reason) override;
  void ReportTimings(const v1::ReportTimingsRequest& report) override;
  std::string DescribeDeadPeers(absl::Duration wait) override;
  absl::StatusOr<int64_t> ReportCommFailure(int64_t comm_epoch,
                                            const std::string& reason) override;

  // KeyValueStore over the coordinator's per-job store.
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;

 private:
  // One Join whose RPC waits up to `timeout`.
  absl::Status JoinOnce(absl::Duration timeout);
  // Start's Join, retried as Start says.
  absl::Status JoinWithRetries(absl::Time deadline,
                               const std::function<bool()>& cancelled);
  // Waits up to `timeout` for Start's Join; Unavailable naming the rank and
  // the coordinator's address when it has not joined by then, at once when
  // Start's latest Join found the coordinator unreachable.
  absl::Status AwaitJoined(absl::Duration timeout);
  // Unavailable naming the coordinator's address and `error`.
  absl::Status CoordinatorUnreachable(absl::string_view error) const;
  // Deadline + token.
  void Prepare(grpc::ClientContext* context, absl::Duration deadline) const;
  void WatchLoop();
  // `refusal` (Plan.round_refused) names this daemon's latest registration.
  bool RefusesCurrentRegistration(const v1::Plan& refusal);
  void ReportLoop();
  // `manifest` with the resume fields set from newest_plan_ / last_step_,
  // under this link's job id.
  v1::PublishManifestRequest WithResumeFields(
      v1::PublishManifestRequest manifest) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string address_;
  const v1::JoinRequest join_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::function<void(const v1::Plan&)> on_plan_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Start's Join succeeded. The Optimizer service serves before that, so a
  // RegisterParams arriving early waits for it (PublishManifest needs it).
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  // The outcome of Start's latest Join (OK before the first).
  absl::Status last_join_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* watch_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::optional<v1::ReportTimingsRequest> pending_report_ ABSL_GUARDED_BY(mu_);
  // The last manifest, re-published after a coordinator restart.
  std::optional<v1::PublishManifestRequest> manifest_ ABSL_GUARDED_BY(mu_);
  std::string registration_ ABSL_GUARDED_BY(mu_);  // id of manifest_
  // Sent with every publish (PublishManifestRequest's resume fields): the
  // newest plan version the watcher delivered and the last step reported
  // since the registration, so a restarted coordinator numbers its plans
  // above ours and activates its first one after our current step.
  int64_t newest_plan_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = 0;
  // Registration ids: "<random per process>-<counter>", so a restarted
  // daemon never repeats an id its previous process used.
  const std::string incarnation_;
  uint64_t registrations_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread watcher_;
  std::thread reporter_;
};

}  // namespace muond
