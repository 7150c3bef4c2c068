#include "server/daemon/step_request.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/echo.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "core/plan/plan_history.h"
#include "server/common/proto_convert.h"

namespace muond {

absl::Status CheckStepId(int64_t id, std::optional<int64_t> last_step_id,
                         int64_t max_step_id) {
  if (id < 0 || id > max_step_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("step_id ", id, " must be in [0, ", max_step_id, "]"));
  }
  if (last_step_id && id != *last_step_id + 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step_id ", id, " does not follow the last applied step_id ",
        *last_step_id, " (expected ", *last_step_id + 1, ", or ", *last_step_id,
        " to replay); after a state load (muonctl load, ImportState) step on "
        "from the id it gives: muond.torch.Muon(..., first_step_id=N), or the "
        "client's next Step id"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepOverrides> ParseOverrides(const v1::StepRequest& request,
                                             const Registration& registration) {
  StepOverrides out = FromProto(request.overrides());
  std::map<std::string, Algorithm> groups;
  for (const BoundGroup& g : registration.groups) {
    groups[g.proto.name()] = g.proto.algorithm() == v1::ALGORITHM_ADAMW
                                 ? Algorithm::kAdamW
                                 : Algorithm::kMuon;
  }
  // A GroupOverride with no field set still names its group; a group named
  // twice is refused (which value would win is the client's bug to see).
  std::set<std::string> seen;
  for (const v1::GroupOverride& o : request.overrides()) {
    if (!groups.contains(o.group())) {
      return absl::InvalidArgumentError(
          absl::StrCat("overrides: unknown group '", Echo(o.group()), "'"));
    }
    if (!seen.insert(o.group()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "overrides: group '", Echo(o.group()),
          "' has more than one GroupOverride (at most one per group and "
          "step); the step was not applied"));
    }
  }
  // The rules' one home is the engine's (which checks again).
  RETURN_IF_ERROR(CheckStepOverrides(out, groups));
  return out;
}

absl::StatusOr<std::set<std::string>> ParseSkipParams(
    const v1::StepRequest& request, const Registration& registration) {
  std::set<std::string> skip(request.skip_params().begin(),
                             request.skip_params().end());
  RETURN_IF_ERROR(CheckSkipParams(skip, [&](const std::string& name) {
    return registration.param_names.contains(name);
  }));
  return skip;
}

void Refuse(StepInputs& inputs, absl::Status st, RefusalCode code) {
  if (st.ok() || !inputs.refusal.ok()) return;
  inputs.refusal = std::move(st);
  inputs.refusal_code = code;
}

absl::Status TrainerRefusal(const v1::StepRequest& request) {
  if (request.trainer_refusal().empty()) return absl::OkStatus();
  return WithErrorReason(
      absl::FailedPreconditionError(absl::StrCat(
          "step ", request.step_id(),
          ": the trainer refused it before sending it (",
          Echo(request.trainer_refusal()), "); no rank applies it")),
      ErrorReason::kTrainerRefused);
}

void CheckStepRequest(const v1::StepRequest& request,
                      const Registration& registration,
                      std::optional<int64_t> last_step_id, int64_t max_step_id,
                      StepInputs& inputs) {
  // The trainer's refusal first: it is why this step never came, whatever
  // else this rank would refuse (its ballot carries one code).
  Refuse(inputs, TrainerRefusal(request), RefusalCode::kTrainer);
  Refuse(inputs, registration.RecheckMemory(), RefusalCode::kMemory);
  Refuse(inputs, CheckStepId(request.step_id(), last_step_id, max_step_id),
         RefusalCode::kStepId);
  absl::StatusOr<StepOverrides> overrides =
      ParseOverrides(request, registration);
  Refuse(inputs, overrides.status(), RefusalCode::kOverrides);
  if (overrides.ok()) inputs.overrides = *std::move(overrides);
  absl::StatusOr<std::set<std::string>> skip =
      ParseSkipParams(request, registration);
  Refuse(inputs, skip.status(), RefusalCode::kSkipParams);
  if (skip.ok()) inputs.skip_params = *std::move(skip);
}

v1::StepResponse StepResponseOf(int64_t step_id, const StepResult& result,
                                int64_t active_plan_version) {
  v1::StepResponse response;
  response.set_step_id(step_id);
  *response.mutable_timings() = ToProto(result.timings);
  response.set_plan_version(
      AgreedPlanVersion(active_plan_version, result.homes_versions));
  for (const std::string& name : result.skipped_nonfinite) {
    response.add_skipped_nonfinite(name);
  }
  return response;
}

v1::ReportTimingsRequest TimingsReportOf(const std::string& job_id, int rank,
                                         const v1::StepResponse& response,
                                         const StepResult& result) {
  v1::ReportTimingsRequest report;
  report.set_job_id(job_id);
  report.set_rank(rank);
  report.set_step_id(response.step_id());
  *report.mutable_timings() = response.timings();
  for (const ShapeTiming& s : result.ns_shapes) {
    *report.add_shapes() = ToProto(s);
  }
  return report;
}

std::string StepLogLine(int64_t step_id, const PhaseTimings& timings,
                        int64_t plan_version) {
  return absl::StrCat("step ", step_id, ": total ", timings.total_us,
                      " us (momentum ", timings.momentum_us, ", a2a ",
                      timings.a2a_fwd_us + timings.a2a_bwd_us, ", ns ",
                      timings.ns_us, ", update ", timings.update_us,
                      "), plan v", plan_version);
}

PeerFailure DescribePeerFailure(int64_t step_id, const absl::Status& st,
                                const std::string& peers, bool healing) {
  const std::string what =
      absl::IsDeadlineExceeded(st)
          ? "a peer daemon did not answer in time (hung or stopped)"
          : "a peer daemon is gone";
  const std::string cause = absl::StrCat(what, peers.empty() ? "" : ": ", peers,
                                         " (", st.message(), ")");
  PeerFailure failure;
  failure.health = absl::StrCat(
      "communicators unusable after step ", step_id, " failed: ", cause,
      healing ? "; the job's daemons rebuild them (the state is kept)"
              : "; re-register the params on every rank, then load the last "
                "checkpoint on every rank (muonctl load)");
  failure.status = WithErrorReason(
      absl::UnavailableError(absl::StrCat(
          "step ", step_id, " failed: ", cause,
          "; nothing of it was applied on this rank; ",
          healing ? "the job's daemons rebuild their communicators: send the "
                    "step again on every rank (no re-registration)"
                  : "re-register the params on every rank (or restart the "
                    "job's daemons) and LoadState")),
      ErrorReason::kPeerGone, {{"step_id", absl::StrCat(step_id)}});
  return failure;
}

}  // namespace muond
