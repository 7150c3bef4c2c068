#include "server/daemon/coordinator_link.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/grpc_status.h"

namespace muond {
namespace {

// No coordinator answered (nothing listens, or it hangs).
bool IsUnreachable(const absl::Status& st) {
  return absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st);
}

std::string RandomIncarnation() {
  std::random_device device;
  std::mt19937_64 rng((uint64_t(device()) << 32) ^ device());
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
}

// One Join attempt's longest wait, and the pause between attempts.
constexpr absl::Duration kJoinAttemptTimeout = absl::Seconds(10);
constexpr absl::Duration kJoinRetryDelay = absl::Milliseconds(100);

// How long a timing report waits before it is sent (see ReportLoop).
constexpr absl::Duration kReportDelay = absl::Milliseconds(2);

// Join refusals that pass by themselves, so Start waits them out until its
// deadline: the coordinator unreachable; the rank still live (usually this
// daemon's previous process, whose plan stream the coordinator has not yet
// seen close: it polls); the job held by live daemons of another world size
// or token (a squatter, or peers about to go away); max_jobs full (idle jobs
// expire).
bool JoinRefusalMayPass(const absl::Status& st) {
  return IsUnreachable(st) || absl::IsAlreadyExists(st) ||
         absl::IsFailedPrecondition(st) || absl::IsResourceExhausted(st);
}

void SetDeadline(grpc::ClientContext* context, absl::Duration d) {
  context->set_deadline(std::chrono::system_clock::now() +
                        absl::ToChronoMilliseconds(d));
}

}  // namespace

GrpcCoordinatorLink::GrpcCoordinatorLink(
    const std::string& address, v1::JoinRequest join,
    std::shared_ptr<grpc::ChannelCredentials> credentials)
    : address_(address),
      join_(std::move(join)),
      stub_(v1::Coordinator::NewStub(
          grpc::CreateChannel(address, std::move(credentials)))),
      incarnation_(RandomIncarnation()) {}

void GrpcCoordinatorLink::Prepare(grpc::ClientContext* context,
                                  absl::Duration deadline) const {
  SetDeadline(context, deadline);
  AttachToken(context, join_.token());
}

std::string GrpcCoordinatorLink::DescribeDeadPeers(absl::Duration wait) {
  // The coordinator marks a rank not live when its plan stream breaks, which
  // may lag the transport error of a collective by a moment: poll briefly.
  const absl::Time deadline = absl::Now() + wait;
  while (true) {
    grpc::ClientContext context;
    Prepare(&context, absl::Seconds(2));
    v1::ListDaemonsRequest request;
    request.set_job_id(join_.job_id());
    v1::ListDaemonsResponse response;
    grpc::Status st = stub_->ListDaemons(&context, request, &response);
    std::vector<std::string> dead;
    if (st.ok()) {
      std::vector<bool> seen(join_.world_size(), false);
      for (const v1::DaemonInfo& d : response.daemons()) {
        if (d.rank() >= 0 && d.rank() < join_.world_size())
          seen[d.rank()] = d.live();
      }
      for (int r = 0; r < join_.world_size(); ++r) {
        if (!seen[r] && r != join_.rank()) dead.push_back(absl::StrCat(r));
      }
      if (!dead.empty()) {
        return absl::StrCat(kDeadRankPhrase, dead.size() > 1 ? "s " : " ",
                            absl::StrJoin(dead, ", "),
                            " (not connected to the coordinator)");
      }
    }
    if (absl::Now() >= deadline) {
      return st.ok() ? "no dead rank known to the coordinator"
                     : absl::StrCat("the coordinator is unreachable (",
                                    st.error_message(), ")");
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

absl::StatusOr<int64_t> GrpcCoordinatorLink::ReportCommFailure(
    int64_t comm_epoch, const std::string& reason) {
  v1::ReportCommFailureRequest request;
  request.set_job_id(join_.job_id());
  request.set_rank(join_.rank());
  request.set_comm_epoch(comm_epoch);
  request.set_reason(reason.substr(0, 1024));
  grpc::ClientContext context;
  Prepare(&context, absl::Seconds(5));  // a failed step's answer waits
  v1::ReportCommFailureResponse response;
  RETURN_IF_ERROR(
      FromGrpc(stub_->ReportCommFailure(&context, request, &response)));
  return response.comm_epoch();
}

GrpcCoordinatorLink::~GrpcCoordinatorLink() { Stop(); }

void GrpcCoordinatorLink::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (watch_context_ != nullptr) watch_context_->TryCancel();
  }
  if (watcher_.joinable()) watcher_.join();
  if (reporter_.joinable()) reporter_.join();
}

absl::Status GrpcCoordinatorLink::JoinOnce(absl::Duration timeout) {
  grpc::ClientContext context;
  Prepare(&context, timeout);
  v1::JoinResponse response;
  return FromGrpc(stub_->Join(&context, join_, &response));
}

absl::Status GrpcCoordinatorLink::JoinWithRetries(
    absl::Time deadline, const std::function<bool()>& cancelled) {
  // What the refusal says it waited: the whole allowance, rounded up (an
  // allowance of 500ms reads "500ms", not "499.98ms").
  const absl::Duration allowed =
      absl::Ceil(std::max(deadline - absl::Now(), absl::ZeroDuration()),
                 absl::Milliseconds(100));
  // The kind of refusal logged last: a wait logs each kind once (a message
  // may change every attempt, e.g. "joined 2s ago").
  absl::StatusCode logged = absl::StatusCode::kOk;
  while (true) {
    // A hung coordinator must not hold an attempt past the deadline.
    const absl::Duration left = deadline - absl::Now();
    absl::Status st =
        JoinOnce(std::clamp(left, absl::Milliseconds(10), kJoinAttemptTimeout));
    {
      absl::MutexLock lock(&mu_);
      last_join_ = st;
    }
    if (st.ok()) return st;
    if (!JoinRefusalMayPass(st)) return WithContext(st, "Join refused: ");
    if (absl::Now() >= deadline) {
      if (IsUnreachable(st)) return CoordinatorUnreachable(st.message());
      return WithContext(st, absl::StrCat("Join refused for ",
                                          absl::FormatDuration(allowed), ": "));
    }
    if (cancelled && cancelled()) {
      return absl::CancelledError(absl::StrCat(
          "the Join was given up (its caller went away); the coordinator's "
          "last refusal: ",
          st.message()));
    }
    if (!IsUnreachable(st) && st.code() != logged) {
      logged = st.code();
      LOG(WARNING) << "Join of job " << join_.job_id() << " waits (up to "
                   << absl::FormatDuration(allowed) << "): " << st;
    }
    absl::SleepFor(std::min(kJoinRetryDelay, deadline - absl::Now()));
  }
}

absl::Status GrpcCoordinatorLink::Start(
    std::function<void(const v1::Plan&)> on_plan, absl::Duration timeout) {
  return Start(std::move(on_plan), absl::Now() + timeout);
}

absl::Status GrpcCoordinatorLink::Start(
    std::function<void(const v1::Plan&)> on_plan, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  on_plan_ = std::move(on_plan);
  RETURN_IF_ERROR(JoinWithRetries(deadline, cancelled));
  LOG(INFO) << "joined job " << join_.job_id() << " as rank " << join_.rank()
            << "/" << join_.world_size();
  {
    absl::MutexLock lock(&mu_);
    joined_ = true;
  }
  watcher_ = std::thread([this] { WatchLoop(); });
  reporter_ = std::thread([this] { ReportLoop(); });
  return absl::OkStatus();
}

void GrpcCoordinatorLink::WatchLoop() {
  bool need_join = false;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    if (need_join) {
      // The coordinator restarted or dropped us: join and re-publish.
      absl::Status st = JoinOnce(kJoinAttemptTimeout);
      if (!st.ok() && !absl::IsAlreadyExists(st)) {
        VLOG(1) << "re-join failed: " << st;
        absl::SleepFor(absl::Milliseconds(500));
        continue;
      }
      std::optional<v1::PublishManifestRequest> manifest;
      std::string registration;
      {
        absl::MutexLock lock(&mu_);
        if (manifest_) manifest = WithResumeFields(*manifest_);
        registration = registration_;
      }
      if (manifest) {
        grpc::ClientContext context;
        Prepare(&context, absl::Seconds(10));
        if (!registration.empty()) {
          context.AddMetadata(kRegistrationMetadata, registration);
        }
        v1::PublishManifestResponse response;
        stub_->PublishManifest(&context, *manifest, &response);
      }
      need_join = false;
    }
    grpc::ClientContext context;
    AttachToken(&context, join_.token());
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      watch_context_ = &context;
    }
    v1::WatchPlansRequest request;
    request.set_job_id(join_.job_id());
    request.set_rank(join_.rank());
    auto reader = stub_->WatchPlans(&context, request);
    v1::Plan plan;
    while (reader->Read(&plan)) {
      if (plan.comm_epoch() > 0) {  // not a plan: the job's epoch moved
        on_plan_(plan);
        continue;
      }
      if (!plan.round_refused().empty()) {
        if (RefusesCurrentRegistration(plan)) on_plan_(plan);
        continue;
      }
      {
        absl::MutexLock lock(&mu_);
        newest_plan_ = std::max(newest_plan_, plan.version());
      }
      on_plan_(plan);
    }
    grpc::Status st = reader->Finish();
    {
      absl::MutexLock lock(&mu_);
      watch_context_ = nullptr;
      if (stopping_) return;
    }
    LOG(WARNING) << "plan stream ended (" << st.error_message()
                 << "); keeping the current plan and reconnecting";
    need_join = true;
    absl::SleepFor(absl::Milliseconds(500));
  }
}

bool GrpcCoordinatorLink::RefusesCurrentRegistration(const v1::Plan& refusal) {
  absl::MutexLock lock(&mu_);
  // The id of the latest registration this daemon published (or is
  // publishing: the refusal may overtake the publish's answer).
  const std::string current =
      registrations_ == 0 ? ""
                          : absl::StrCat(incarnation_, "-", registrations_);
  if (current.empty() || refusal.refused_registration() != current) {
    VLOG(1) << "registration round refusal not for this rank's registration "
            << current << ": " << refusal.round_refused();
    return false;
  }
  return true;
}

void GrpcCoordinatorLink::ReportLoop() {
  while (true) {
    v1::ReportTimingsRequest report;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || pending_report_.has_value();
      };
      mu_.Await(absl::Condition(&ready));
      // The report was posted by a Step handler that has yet to send its
      // response: sending now puts an RPC to the coordinator (and its
      // thread wake-ups) on the step's critical path. Wait a moment; newer
      // reports meanwhile replace this one (ReportTimings).
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), kReportDelay);
      if (stopping_) return;
      report = *pending_report_;
      pending_report_.reset();
    }
    report.set_job_id(join_.job_id());  // as WithResumeFields says
    grpc::ClientContext context;
    Prepare(&context, absl::Seconds(5));
    v1::ReportTimingsResponse response;
    grpc::Status st = stub_->ReportTimings(&context, report, &response);
    if (!st.ok()) VLOG(1) << "ReportTimings failed: " << st.error_message();
  }
}

v1::PublishManifestRequest GrpcCoordinatorLink::WithResumeFields(
    v1::PublishManifestRequest manifest) {
  // The link's job: an optimizer instance's core names its user's job, the
  // coordinator knows the instance by its own (InstanceJobId).
  manifest.set_job_id(join_.job_id());
  manifest.set_known_plan_version(newest_plan_);
  manifest.set_last_step_id(last_step_);
  return manifest;
}

absl::Status GrpcCoordinatorLink::PublishManifest(
    const v1::PublishManifestRequest& plain) {
  v1::PublishManifestRequest manifest;
  {
    absl::MutexLock lock(&mu_);
    manifest = WithResumeFields(plain);
  }
  grpc::ClientContext context;
  Prepare(&context, absl::Seconds(30));
  v1::PublishManifestResponse response;
  absl::Status st =
      FromGrpc(stub_->PublishManifest(&context, manifest, &response));
  if (st.ok()) {
    absl::MutexLock lock(&mu_);
    manifest_ = plain;
  }
  return st;
}

absl::Status GrpcCoordinatorLink::CoordinatorUnreachable(
    absl::string_view error) const {
  return absl::UnavailableError(absl::StrCat(
      "the coordinator at ", address_, " (--coordinator) is unreachable (",
      error, "): is muond-coordinator running there?"));
}

absl::Status GrpcCoordinatorLink::AwaitJoined(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  // Start's latest Join found no coordinator: say so now rather than after
  // `timeout` (the trainer's deadline may be shorter).
  auto joined = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return joined_ || stopping_ || IsUnreachable(last_join_);
  };
  mu_.AwaitWithTimeout(absl::Condition(&joined), timeout);
  if (joined_) return absl::OkStatus();
  if (IsUnreachable(last_join_)) {
    return CoordinatorUnreachable(last_join_.message());
  }
  return absl::UnavailableError(absl::StrCat(
      "rank ", join_.rank(), " has not joined job '", join_.job_id(),
      "' at the coordinator at ", address_, " yet",
      last_join_.ok() ? "" : absl::StrCat(" (", last_join_.message(), ")")));
}

absl::Status GrpcCoordinatorLink::PublishRefusal(const std::string& reason) {
  // Short waits: the trainer's answer waits for this.
  RETURN_IF_ERROR(AwaitJoined(absl::Seconds(5)));
  v1::PublishManifestRequest refusal;
  refusal.set_job_id(join_.job_id());
  refusal.set_rank(join_.rank());
  refusal.set_registration_refused(reason);
  grpc::ClientContext context;
  Prepare(&context, absl::Seconds(5));
  v1::PublishManifestResponse response;
  return FromGrpc(stub_->PublishManifest(&context, refusal, &response));
}

absl::StatusOr<int64_t> GrpcCoordinatorLink::PublishRegistration(
    const v1::PublishManifestRequest& manifest) {
  RETURN_IF_ERROR(AwaitJoined(absl::Seconds(30)));
  std::string registration;
  {
    absl::MutexLock lock(&mu_);
    registration = absl::StrCat(incarnation_, "-", ++registrations_);
    last_step_ = 0;  // a new registration: its steps start again
  }
  v1::PublishManifestRequest published;
  {
    absl::MutexLock lock(&mu_);
    published = WithResumeFields(manifest);
  }
  grpc::ClientContext context;
  Prepare(&context, absl::Seconds(30));
  context.AddMetadata(kRegistrationMetadata, registration);
  v1::PublishManifestResponse response;
  absl::Status st =
      FromGrpc(stub_->PublishManifest(&context, published, &response));
  if (IsUnreachable(st)) return CoordinatorUnreachable(st.message());
  if (!st.ok()) return st;
  int64_t round_version = 0;
  const auto& trailers = context.GetServerTrailingMetadata();
  auto it = trailers.find(kRoundPlanVersionMetadata);
  if (it == trailers.end() ||
      !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()),
                        &round_version)) {
    round_version = 0;  // an older coordinator: any plan
  }
  absl::MutexLock lock(&mu_);
  manifest_ = manifest;
  registration_ = registration;
  return round_version;
}

void GrpcCoordinatorLink::ReportTimings(
    const v1::ReportTimingsRequest& report) {
  absl::MutexLock lock(&mu_);
  last_step_ = std::max(last_step_, report.step_id());
  // Only the latest report is kept while the sender is busy; keep the shape
  // timings of a measured step the newer (unmeasured) report would drop.
  if (report.shapes_size() == 0 && pending_report_.has_value() &&
      pending_report_->shapes_size() > 0) {
    v1::ReportTimingsRequest merged = report;
    *merged.mutable_shapes() = pending_report_->shapes();
    pending_report_ = std::move(merged);
    return;
  }
  pending_report_ = report;
}

absl::Status GrpcCoordinatorLink::Set(const std::string& key,
                                      const std::string& value) {
  v1::KvSetRequest request;
  request.set_job_id(join_.job_id());
  request.set_key(key);
  request.set_value(value);
  grpc::ClientContext context;
  Prepare(&context, absl::Seconds(30));
  v1::KvSetResponse response;
  return FromGrpc(stub_->KvSet(&context, request, &response));
}

absl::StatusOr<std::string> GrpcCoordinatorLink::Get(const std::string& key,
                                                     absl::Duration timeout) {
  v1::KvGetRequest request;
  request.set_job_id(join_.job_id());
  request.set_key(key);
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  grpc::ClientContext context;
  Prepare(&context, timeout + absl::Seconds(10));
  v1::KvGetResponse response;
  absl::Status st = FromGrpc(stub_->KvGet(&context, request, &response));
  if (!st.ok()) return st;
  return response.value();
}

}  // namespace muond
