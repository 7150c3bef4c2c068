#pragma once
// The servers' answer to the standard grpc.health.v1.Health service, our own
// rather than gRPC's default one so that Watch streams are bounded: the
// service takes no token (docs/ARCHITECTURE.md "Security"), so anyone who
// reaches the port could otherwise hold any number of streams open.
#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace muond {

// At most this many Watch streams are open on one server at a time; one
// more is RESOURCE_EXHAUSTED (server/README.md "Health"). A probe needs one
// per prober: the rest is slack for restarts.
inline constexpr int kMaxHealthWatches = 64;

// The status of the empty service name (the whole server) and `service` (the
// generated service's full name, e.g. "muond.v1.Optimizer"); any other name
// is NOT_FOUND on Check and SERVICE_UNKNOWN on Watch. Callback API: an open
// Watch stream costs no thread. Thread-safe; must outlive the server that
// serves it (StartGrpcServer registers it).
class HealthStatus final : public grpc::health::v1::Health::CallbackService {
 public:
  HealthStatus(std::string service, bool serving);
  ~HealthStatus() override;

  void Set(bool serving);
  // NOT_SERVING for good (graceful shutdown begins): every Watch stream hears
  // it and then ends, so no stream holds the server's drain.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request,
      grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* context,
      const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  class WatchStream;
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  ServingStatus StatusOf(const std::string& service) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Forget(WatchStream* stream);

  const std::string service_;
  absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<WatchStream*> watches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muond
