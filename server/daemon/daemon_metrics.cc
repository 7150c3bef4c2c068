#include "server/daemon/daemon_metrics.h"

#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "core/common/error_reason.h"
#include "core/common/state_storage.h"
#include "server/common/version.h"

namespace muond {
namespace {

// The label values of muond_step_phase_seconds, PhaseTimings' fields.
constexpr const char* kPhases[] = {"momentum", "a2a_fwd", "ns",   "a2a_bwd",
                                   "dp_share", "update",  "total"};

// Every reason label StepDone can produce: each ErrorReason (the enum is
// dense; ErrorReasonName answers the unspecified name past its end), each
// non-OK canonical code (a refusal without a reason) and NONFINITE_SKIPPED.
// Pre-created at 0 so rate() sees a series' first increment.
std::vector<std::string> AllRefusalReasons() {
  std::vector<std::string> reasons;
  const absl::string_view unspecified =
      ErrorReasonName(ErrorReason::kUnspecified);
  for (int r = 1; ErrorReasonName(ErrorReason(r)) != unspecified; ++r) {
    reasons.emplace_back(ErrorReasonName(ErrorReason(r)));
  }
  for (int code = int(absl::StatusCode::kCancelled);
       code <= int(absl::StatusCode::kUnauthenticated); ++code) {
    reasons.push_back(absl::StatusCodeToString(absl::StatusCode(code)));
  }
  reasons.push_back("NONFINITE_SKIPPED");
  return reasons;
}

// Every (location, dtype) label pair of muond_state_bytes, pre-created at 0
// so a dashboard sees every series before the first engine.
std::vector<std::vector<std::string>> AllStateStorageLabels() {
  std::vector<std::vector<std::string>> labels;
  for (StateLocation l : {StateLocation::kDevice, StateLocation::kHost}) {
    for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3}) {
      labels.push_back(
          {std::string(StateLocationName(l)), std::string(DTypeName(d))});
    }
  }
  return labels;
}

}  // namespace

DaemonMetrics::DaemonMetrics()
    : registry_(std::make_unique<MetricsRegistry>()),
      phase_seconds_(registry_->AddHistogram(
          "muond_step_phase_seconds",
          "Time of each phase of an applied step on this rank (the step's "
          "PhaseTimings: GPU time between events on a device, wall time on "
          "the host; total = the whole step's wall time, votes included)",
          StepPhaseBuckets(), {"phase"})),
      steps_applied_(
          registry_
              ->AddCounter("muond_steps_applied_total",
                           "Steps applied on this rank (replays not counted)")
              .With()),
      steps_refused_(registry_->AddCounter(
          "muond_steps_refused_total",
          "Steps answered with an error, nothing applied, by reason: the "
          "error's ErrorReason name, else its gRPC code name (non-finite "
          "gradients on this rank: INVALID_ARGUMENT; a step another rank "
          "refused: REFUSED_BY_PEER); NONFINITE_SKIPPED: skipped for "
          "non-finite gradients (--skip_nonfinite)",
          {"reason"})),
      exchange_bytes_(registry_->AddCounter(
          "muond_exchange_bytes_total",
          "Bytes of the step exchanges (all_to_allv of a2a_fwd, a2a_bwd and "
          "dp_share) this rank sent to / received from other ranks, counted "
          "at its communicators as each exchange completes (the votes and "
          "the rank's blocks to itself not counted)",
          {"direction"})),
      sent_(exchange_bytes_.With({"sent"})),
      received_(exchange_bytes_.With({"received"})),
      plan_version_(registry_
                        ->AddGauge("muond_plan_version",
                                   "Version of the plan active on this rank "
                                   "(0: none yet for this registration)")
                        .With()),
      ns_load_(registry_
                   ->AddGauge("muond_ns_load",
                              "This rank's share of the active plan's NS cost "
                              "(its rank_load over the sum of every rank's), "
                              "0..1")
                   .With()),
      ns_workspace_bytes_(
          registry_
              ->AddGauge("muond_ns_workspace_bytes",
                         "Bytes the Newton-Schulz workspaces of the engine "
                         "take (bounded by free device memory and "
                         "--max_ns_workspace_bytes)")
              .With()),
      step_channels_open_(
          registry_
              ->AddGauge("muond_step_channels_open",
                         "Step channels open (trainers sending steps through "
                         "shared memory instead of the Step RPC)")
              .With()),
      state_bytes_(registry_->AddGauge(
          "muond_state_bytes",
          "Bytes of optimizer state of the engine (momentum, AdamW moments, "
          "the variants' second moments) by where it lives (location: "
          "device, host) and its dtype (fp32, bf16, fp8_e4m3 with its block "
          "scales)",
          {"location", "dtype"})),
      ns_seconds_(registry_
                      ->AddCounter("muond_ns_seconds_total",
                                   "Newton-Schulz phase time of applied steps "
                                   "on this rank, seconds")
                      .With()),
      registrations_(registry_->AddCounter(
          "muond_registrations_total",
          "RegisterParams calls by result (accepted or refused)", {"result"})),
      registered_params_(registry_
                             ->AddGauge("muond_registered_params",
                                        "Params registered on this daemon")
                             .With()),
      engine_build_failures_(
          registry_
              ->AddCounter("muond_engine_build_failures_total",
                           "Step engine builds that failed (communicators, "
                           "backend or engine creation)")
              .With()) {
  registry_
      ->AddGauge("muond_build_info", "muond's version; always 1", {"version"})
      .With({kMuondVersion})
      .Set(1);
  // Resolved once: a step's observations then take no label lookup.
  static_assert(std::size(kPhases) == kStepPhases);
  for (size_t i = 0; i < std::size(kPhases); ++i) {
    phase_children_[i] = &phase_seconds_.With({kPhases[i]});
  }
  for (const std::vector<std::string>& labels : AllStateStorageLabels()) {
    state_bytes_.With(labels);
  }
  registrations_.With({"accepted"});
  registrations_.With({"refused"});
  for (const std::string& reason : AllRefusalReasons()) {
    steps_refused_.With({reason});
  }
}

std::string DaemonMetrics::RefusalReason(const absl::Status& status) {
  const ErrorReason reason = GetErrorReason(status);
  if (reason != ErrorReason::kUnspecified) {
    return std::string(ErrorReasonName(reason));
  }
  return absl::StatusCodeToString(status.code());
}

void DaemonMetrics::StepDone(const absl::StatusOr<v1::StepResponse>& outcome) {
  if (!outcome.ok()) {
    steps_refused_.With({RefusalReason(outcome.status())}).Increment();
    return;
  }
  if (outcome->replayed()) return;
  if (!outcome->skipped_nonfinite().empty()) {
    steps_refused_.With({"NONFINITE_SKIPPED"}).Increment();
    return;
  }
  const v1::StepTimings& t = outcome->timings();
  const double us[] = {t.momentum_us(), t.a2a_fwd_us(),  t.ns_us(),
                       t.a2a_bwd_us(),  t.dp_share_us(), t.update_us(),
                       t.total_us()};
  static_assert(sizeof(us) / sizeof(us[0]) == std::size(kPhases));
  for (size_t i = 0; i < std::size(kPhases); ++i) {
    phase_children_[i]->Observe(us[i] * 1e-6);
  }
  ns_seconds_.Increment(t.ns_us() * 1e-6);
  steps_applied_.Increment();
}

void DaemonMetrics::RegistrationDone(
    const absl::StatusOr<v1::RegisterParamsResponse>& r) {
  if (!r.ok()) {
    registrations_.With({"refused"}).Increment();
    return;
  }
  registrations_.With({"accepted"}).Increment();
  registered_params_.Set(double(r->num_params()));
  PlanActive(0, 0);
}

void DaemonMetrics::Unregistered() {
  registered_params_.Set(0);
  PlanActive(0, 0);
  StateBytes({});
}

void DaemonMetrics::StateBytes(
    const google::protobuf::RepeatedPtrField<v1::StateBytes>& by) {
  for (const std::vector<std::string>& labels : AllStateStorageLabels()) {
    state_bytes_.With(labels).Set(0);
  }
  for (const v1::StateBytes& b : by) {
    state_bytes_.With({b.location(), b.dtype()}).Set(double(b.bytes()));
  }
}

void DaemonMetrics::PlanActive(int64_t version, double ns_load) {
  plan_version_.Set(double(version));
  ns_load_.Set(ns_load);
}

}  // namespace muond
