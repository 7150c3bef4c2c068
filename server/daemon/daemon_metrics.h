#pragma once
// muond's metrics (server/README.md "Metrics" lists them): what DaemonCore
// and the engine's communicators report, one call per event.
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/common/metrics.h"

namespace muond {

class DaemonMetrics {
 public:
  // The daemon's families in a registry of its own (so a communicator that
  // counts into it can never outlive it).
  DaemonMetrics();

  // What muond serves on --metrics_port.
  MetricsRegistry& registry() { return *registry_; }

  // Step's outcome: an error is a refused step, by reason (see StepRefused);
  // a replay counts nothing (it was counted when applied); a step skipped for
  // non-finite gradients (--skip_nonfinite) is refused with reason
  // NONFINITE_SKIPPED; else it was applied and its phase times are observed.
  void StepDone(const absl::StatusOr<v1::StepResponse>& outcome);
  // RegisterParams's outcome: accepted (registered_params = num_params; the
  // new registration has no active plan yet) or refused.
  void RegistrationDone(const absl::StatusOr<v1::RegisterParamsResponse>& r);
  // UnregisterParams cleared the registration (no params, no plan).
  void Unregistered();
  // The plan `version` is active from this step on, giving this rank
  // `ns_load` of its NS cost (NsLoadShare).
  void PlanActive(int64_t version, double ns_load);
  void EngineBuildFailed() { engine_build_failures_.Increment(); }
  // The bytes the engine's Newton-Schulz workspaces take.
  void NsWorkspace(int64_t bytes) { ns_workspace_bytes_.Set(double(bytes)); }
  // Step channels open now (StepChannelOptions.open_changed).
  void StepChannelsOpen(int open) { step_channels_open_.Set(double(open)); }
  // The engine's optimizer state by location and dtype (GetStatusResponse's
  // state_bytes_by): every other pair reads 0, as after Unregistered.
  void StateBytes(const google::protobuf::RepeatedPtrField<v1::StateBytes>& by);

  // The exchange bytes the engine's communicators count (ExchangeCounting).
  Counter& exchange_sent() { return sent_; }
  Counter& exchange_received() { return received_; }

  // The reason label of a refused step: the status's ErrorReason name
  // (core/common/error_reason.h) when it carries one, else its canonical
  // code's name (e.g. INVALID_ARGUMENT for non-finite gradients on this
  // rank; REFUSED_BY_PEER where another rank refused the step).
  static std::string RefusalReason(const absl::Status& status);

 private:
  const std::unique_ptr<MetricsRegistry> registry_;
  Family<Histogram>& phase_seconds_;
  // One child per phase (PhaseTimings' order), looked up once.
  static constexpr size_t kStepPhases = 7;
  std::array<Histogram*, kStepPhases> phase_children_{};
  Counter& steps_applied_;
  Family<Counter>& steps_refused_;
  Family<Counter>& exchange_bytes_;
  Counter& sent_;
  Counter& received_;
  Gauge& plan_version_;
  Gauge& ns_load_;
  Gauge& ns_workspace_bytes_;
  Gauge& step_channels_open_;
  Family<Gauge>& state_bytes_;
  Counter& ns_seconds_;
  Family<Counter>& registrations_;
  Gauge& registered_params_;
  Counter& engine_build_failures_;
};

}  // namespace muond
