#pragma once
// The Optimizer gRPC service: a thin layer over the daemon's optimizer
// instances (OptimizerTable), each request routed by its `optimizer` name.
#include <memory>
#include <string>

#include "muond/v1/muond.grpc.pb.h"
#include "server/daemon/daemon_core.h"
#include "server/daemon/optimizer_table.h"
#include "server/daemon/step_channel.h"

namespace muond {

class OptimizerService final : public v1::Optimizer::Service {
 public:
  // `token`: when non-empty every RPC must carry it (server/common/auth.h).
  // `import_idle`: an ImportState stream with no message for this long is
  // cancelled (tests shorten it).
  // `channels`: the step channels' limits (step_channel.h).
  explicit OptimizerService(OptimizerTable* table, std::string token = "",
                            absl::Duration import_idle = kImportIdleTimeout,
                            StepChannelOptions channels = {})
      : table_(table),
        token_(std::move(token)),
        import_idle_(import_idle),
        channels_(StepHandlerOf(this), channels) {}
  // Over `core` alone (the default instance; a named one is refused).
  explicit OptimizerService(DaemonCore* core, std::string token = "",
                            absl::Duration import_idle = kImportIdleTimeout)
      : own_table_(std::make_unique<OptimizerTable>(core)),
        table_(own_table_.get()),
        token_(std::move(token)),
        import_idle_(import_idle),
        channels_(StepHandlerOf(this), {}) {}

  grpc::Status RegisterParams(grpc::ServerContext*,
                              const v1::RegisterParamsRequest*,
                              v1::RegisterParamsResponse*) override;
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest*,
                    v1::StepResponse*) override;
  grpc::Status OpenStepChannel(grpc::ServerContext*,
                               const v1::OpenStepChannelRequest*,
                               v1::OpenStepChannelResponse*) override;
  grpc::Status UnregisterParams(grpc::ServerContext*,
                                const v1::UnregisterParamsRequest*,
                                v1::UnregisterParamsResponse*) override;
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse*) override;
  grpc::Status SaveState(grpc::ServerContext*, const v1::SaveStateRequest*,
                         v1::SaveStateResponse*) override;
  grpc::Status LoadState(grpc::ServerContext*, const v1::LoadStateRequest*,
                         v1::LoadStateResponse*) override;
  grpc::Status ExportState(grpc::ServerContext*, const v1::ExportStateRequest*,
                           grpc::ServerWriter<v1::StateChunk>*) override;
  grpc::Status ImportState(grpc::ServerContext*,
                           grpc::ServerReader<v1::StateChunk>*,
                           v1::ImportStateResponse*) override;
  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*,
                      v1::HealthResponse*) override;

  // Step channels stop taking requests (at shutdown, with the server's own
  // Shutdown); a step in flight finishes.
  void ShutdownStepChannels() { channels_.Shutdown(); }
  StepChannels& step_channels() { return channels_; }

 private:
  static StepHandler StepHandlerOf(OptimizerService* service);
  // A Step, by either transport, after the token check.
  absl::StatusOr<v1::StepResponse> StepOn(const v1::StepRequest& request,
                                          const TrainerVerdict& verdict);
  // The core of instance `name`, or the refusal naming it.
  absl::StatusOr<std::shared_ptr<DaemonCore>> CoreOf(const std::string& name);

  const std::unique_ptr<OptimizerTable> own_table_;
  OptimizerTable* const table_;
  const std::string token_;
  const absl::Duration import_idle_;
  // Last: its threads call StepOn until they are joined.
  StepChannels channels_;
};

}  // namespace muond
