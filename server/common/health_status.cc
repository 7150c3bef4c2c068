#include "server/common/health_status.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muond {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// One open Watch: sends the watched status whenever it changes (the latest
// one only, when changes come faster than the client reads). gRPC calls are
// made outside mu_: a reaction may run inline on the calling thread.
class HealthStatus::WatchStream final
    : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  WatchStream(HealthStatus* owner, std::string service)
      : owner_(owner), service_(std::move(service)) {}

  const std::string& service() const { return service_; }

  void Send(ServingStatus status) {
    {
      absl::MutexLock lock(&mu_);
      if (done_ || (last_sent_ == status && !pending_)) return;
      pending_ = status;
    }
    Pump();
  }

  // After what is pending has been written, the stream ends with OK.
  void End() {
    {
      absl::MutexLock lock(&mu_);
      ending_ = true;
    }
    Pump();
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) ending_ = true;  // the client is gone: stop writing
      if (!ok) pending_.reset();
    }
    Pump();
  }

  void OnCancel() override { End(); }

  void OnDone() override {
    owner_->Forget(this);
    delete this;
  }

 private:
  // Starts the next write, or the finish once nothing is left to write.
  void Pump() {
    std::optional<grpc::Status> finish;
    bool write = false;
    {
      absl::MutexLock lock(&mu_);
      if (done_ || writing_) return;
      if (pending_) {
        response_.set_status(*pending_);
        last_sent_ = *pending_;
        pending_.reset();
        writing_ = write = true;
      } else if (ending_) {
        done_ = true;
        finish = grpc::Status::OK;
      }
    }
    if (write) StartWrite(&response_);
    if (finish) Finish(*finish);
  }

  HealthStatus* const owner_;
  const std::string service_;
  absl::Mutex mu_;
  std::optional<ServingStatus> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<ServingStatus> last_sent_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  // Written by the one Pump that set writing_, read by gRPC until
  // OnWriteDone.
  HealthCheckResponse response_;
};

namespace {

// A Watch refused before it starts (too many open).
class RefusedWatch final
    : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  explicit RefusedWatch(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

HealthStatus::HealthStatus(std::string service, bool serving)
    : service_(std::move(service)), serving_(serving) {}

HealthStatus::~HealthStatus() = default;

HealthStatus::ServingStatus HealthStatus::StatusOf(
    const std::string& service) const {
  if (service != "" && service != service_) {
    return HealthCheckResponse::SERVICE_UNKNOWN;
  }
  return serving_ ? HealthCheckResponse::SERVING
                  : HealthCheckResponse::NOT_SERVING;
}

void HealthStatus::Set(bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_ || serving == serving_) return;
  serving_ = serving;
  for (WatchStream* watch : watches_) watch->Send(StatusOf(watch->service()));
}

void HealthStatus::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  shut_down_ = true;
  serving_ = false;
  for (WatchStream* watch : watches_) {
    watch->Send(StatusOf(watch->service()));
    watch->End();
  }
}

void HealthStatus::Forget(WatchStream* stream) {
  absl::MutexLock lock(&mu_);
  watches_.erase(stream);
}

grpc::ServerUnaryReactor* HealthStatus::Check(
    grpc::CallbackServerContext* context, const HealthCheckRequest* request,
    HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::MutexLock lock(&mu_);
  const ServingStatus status = StatusOf(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service"));
  } else {
    response->set_status(status);
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthStatus::Watch(
    grpc::CallbackServerContext* /*context*/,
    const HealthCheckRequest* request) {
  absl::MutexLock lock(&mu_);
  if (watches_.size() >= size_t{kMaxHealthWatches}) {
    return new RefusedWatch(grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("grpc.health.v1 Watch: ", kMaxHealthWatches,
                     " streams are open on this server, the most it keeps; "
                     "close one or poll with Check")));
  }
  auto* watch = new WatchStream(this, request->service());
  watches_.insert(watch);
  watch->Send(StatusOf(watch->service()));
  if (shut_down_) watch->End();
  return watch;
}

}  // namespace muond
