#include "server/daemon/optimizer_service.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/common/error_reason.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/grpc_status.h"

namespace muond {
namespace {

// `refusal_severity`: how a refusal is logged (a refused OpenStepChannel
// is no warning: the trainer goes on with the Step RPC).
template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* response, const char* rpc,
                   google::LogSeverity refusal_severity = google::WARNING) {
  if (!result.ok()) {
    LOG_AT_LEVEL(refusal_severity) << rpc << " refused: " << result.status();
    return ToGrpc(result.status());
  }
  *response = *std::move(result);
  return grpc::Status::OK;
}

}  // namespace

absl::StatusOr<std::shared_ptr<DaemonCore>> OptimizerService::CoreOf(
    const std::string& name) {
  absl::StatusOr<std::shared_ptr<OptimizerInstance>> found = table_->Find(name);
  if (!found.ok()) return found.status();
  return (*found)->core;
}

grpc::Status OptimizerService::RegisterParams(
    grpc::ServerContext* context, const v1::RegisterParamsRequest* request,
    v1::RegisterParamsResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  const auto rpc_deadline = context->deadline();
  const absl::Time deadline =
      rpc_deadline == std::chrono::system_clock::time_point::max()
          ? absl::InfiniteFuture()
          : absl::FromChrono(rpc_deadline);
  return Reply(
      table_->Register(
          *request, [context] { return context->IsCancelled(); }, deadline),
      response, "RegisterParams");
}

StepHandler OptimizerService::StepHandlerOf(OptimizerService* service) {
  return [service](const v1::StepRequest& request,
                   const TrainerVerdict& verdict) {
    absl::StatusOr<v1::StepResponse> answer = service->StepOn(request, verdict);
    if (!answer.ok() &&
        GetErrorReason(answer.status()) != ErrorReason::kStepWithdrawn) {
      LOG(WARNING) << "Step (step channel) refused: " << answer.status();
    }
    return answer;
  };
}

absl::StatusOr<v1::StepResponse> OptimizerService::StepOn(
    const v1::StepRequest& request, const TrainerVerdict& verdict) {
  absl::StatusOr<std::shared_ptr<DaemonCore>> core =
      CoreOf(request.optimizer());
  if (!core.ok()) return core.status();
  return (*core)->Step(request, verdict);
}

grpc::Status OptimizerService::Step(grpc::ServerContext* context,
                                    const v1::StepRequest* request,
                                    v1::StepResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  // A step answered through a step channel but too large for it: its
  // answer as it was, not the step run again (StepChannels::TakeKeptAnswer).
  if (std::optional<absl::StatusOr<v1::StepResponse>> kept =
          channels_.TakeKeptAnswer(*request)) {
    return Reply(*std::move(kept), response, "Step");
  }
  return Reply(StepOn(*request, TrainerVerdict()), response, "Step");
}

grpc::Status OptimizerService::OpenStepChannel(
    grpc::ServerContext* context, const v1::OpenStepChannelRequest* request,
    v1::OpenStepChannelResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  return Reply(channels_.Open(*request), response,
               "OpenStepChannel (the trainer uses the Step RPC)", google::INFO);
}

grpc::Status OptimizerService::UnregisterParams(
    grpc::ServerContext* context, const v1::UnregisterParamsRequest* request,
    v1::UnregisterParamsResponse*) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  return ToGrpc(table_->Unregister(*request));
}

grpc::Status OptimizerService::GetStatus(grpc::ServerContext* context,
                                         const v1::GetStatusRequest* request,
                                         v1::GetStatusResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  return Reply(table_->Status(request->optimizer()), response, "GetStatus");
}

grpc::Status OptimizerService::SaveState(grpc::ServerContext* context,
                                         const v1::SaveStateRequest* request,
                                         v1::SaveStateResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  absl::StatusOr<std::shared_ptr<DaemonCore>> core =
      CoreOf(request->optimizer());
  if (!core.ok())
    return Reply<v1::SaveStateResponse>(core.status(), response, "SaveState");
  return Reply((*core)->SaveState(*request,
                                  [context] { return context->IsCancelled(); }),
               response, "SaveState");
}

grpc::Status OptimizerService::LoadState(grpc::ServerContext* context,
                                         const v1::LoadStateRequest* request,
                                         v1::LoadStateResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  absl::StatusOr<std::shared_ptr<DaemonCore>> core =
      CoreOf(request->optimizer());
  if (!core.ok())
    return Reply<v1::LoadStateResponse>(core.status(), response, "LoadState");
  return Reply((*core)->LoadState(*request,
                                  [context] { return context->IsCancelled(); }),
               response, "LoadState");
}

grpc::Status OptimizerService::ExportState(
    grpc::ServerContext* context, const v1::ExportStateRequest* request,
    grpc::ServerWriter<v1::StateChunk>* writer) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  absl::StatusOr<std::shared_ptr<DaemonCore>> core =
      CoreOf(request->header().optimizer());
  absl::Status st = !core.ok()
                        ? core.status()
                        : (*core)->ExportState(
                              *request, [writer](const v1::StateChunk& chunk) {
                                return writer->Write(chunk);
                              });
  if (!st.ok()) LOG(WARNING) << "ExportState refused: " << st;
  return ToGrpc(st);
}

grpc::Status OptimizerService::ImportState(
    grpc::ServerContext* context, grpc::ServerReader<v1::StateChunk>* reader,
    v1::ImportStateResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  // The sync API's Read cannot time out: a watcher cancels the stream once
  // no message came for import_idle_, which ends the blocked Read.
  std::atomic<int64_t> last_message_ns = absl::GetCurrentTimeNanos();
  absl::Notification done;
  std::thread watcher([&] {
    const absl::Duration poll =
        std::min(import_idle_ / 4, absl::Milliseconds(500));
    while (!done.WaitForNotificationWithTimeout(poll)) {
      if (absl::GetCurrentTimeNanos() - last_message_ns.load() >
          absl::ToInt64Nanoseconds(import_idle_)) {
        LOG(WARNING) << "ImportState: no message for "
                     << absl::FormatDuration(import_idle_)
                     << "; cancelling the stream";
        context->TryCancel();
        return;
      }
    }
  });
  const auto read = [&](v1::StateChunk* chunk) {
    const bool got = reader->Read(chunk);
    last_message_ns.store(absl::GetCurrentTimeNanos());
    return got;
  };
  // The header chunk names the instance: read it here, hand it on first.
  std::optional<v1::StateChunk> first(std::in_place);
  if (!read(&*first)) first.reset();
  absl::StatusOr<std::shared_ptr<DaemonCore>> core =
      CoreOf(first ? first->header().optimizer() : "");
  absl::StatusOr<v1::ImportStateResponse> result =
      !core.ok() ? absl::StatusOr<v1::ImportStateResponse>(core.status())
                 : (*core)->ImportState(
                       [&](v1::StateChunk* chunk) {
                         if (!first) return read(chunk);
                         *chunk = *std::move(first);
                         first.reset();
                         return true;
                       },
                       [context] { return context->IsCancelled(); });
  done.Notify();
  watcher.join();
  return Reply(std::move(result), response, "ImportState");
}

grpc::Status OptimizerService::Health(grpc::ServerContext* context,
                                      const v1::HealthRequest* request,
                                      v1::HealthResponse* response) {
  if (grpc::Status a = CheckToken(*context, token_); !a.ok()) return a;
  return Reply(table_->Health(*request), response, "Health");
}

}  // namespace muond
