#pragma once
// Registration rounds and their refusals: a round is the set of manifests
// the job's ranks publish since its latest plan; once every rank published,
// the job gets its next plan. A refused publish refuses the whole round:
// every manifest of the round is dropped, the refusal is recorded on the Job
// for the plan streams, and a later re-publish of a refused or dropped
// registration is refused with that round's reason. Not thread-safe:
// CoordinatorCore calls it under its mutex.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/coordinator_metrics.h"
#include "server/coordinator/job.h"
#include "server/coordinator/job_planner.h"

namespace muond {

// FailedPrecondition while some ranks but not all published a new
// registration since the latest plan, or not every rank has a manifest.
absl::Status CheckNoRoundInProgress(const Job& job);

class RegistrationRounds {
 public:
  // A plan of a coordinator that restarted under stepping daemons activates
  // `rebalance_activate_margin` steps after their latest step. `planner` and
  // `metrics` are not owned.
  RegistrationRounds(int64_t rebalance_activate_margin,
                     const JobPlanner* planner, CoordinatorMetrics* metrics)
      : rebalance_activate_margin_(rebalance_activate_margin),
        planner_(planner),
        metrics_(metrics) {}

  // CoordinatorCore::PublishRegistration for the joined rank `daemon` of
  // `job`; `valid` is ValidatePublishFields of the request (a failure
  // refuses the round). Returns the lowest plan version of the round.
  absl::StatusOr<int64_t> Publish(Job& job, Daemon& daemon,
                                  const v1::PublishManifestRequest& published,
                                  const std::string& registration,
                                  const absl::Status& valid);

 private:
  // Publish for a request that passed ValidatePublishFields.
  absl::StatusOr<int64_t> PublishJoined(
      Job& job, Daemon& daemon, const v1::PublishManifestRequest& published,
      const std::string& registration);
  // A publish of `refused_rank` was refused: drops every manifest of the
  // registration round (published since the latest plan) and the refused
  // rank's own, so a retry is compared with, and planned from, nothing of
  // the refused attempt.
  // The refusal is pushed to every rank's plan stream, naming to each rank
  // the registration of its that was dropped (`registration` for the refused
  // rank's own attempt).
  // `reason` is the text pushed (Plan.round_refused).
  void RefuseRound(Job& job, int refused_rank, const std::string& registration,
                   absl::StatusCode code, const std::string& reason);
  // The rule for publishes after a refused round: a publish of a registration
  // the refused round refused or dropped belongs to the refused attempt (a
  // reconnect's re-publish; its trainer heard the refusal and registers
  // again), so it is refused with that round's reason and changes nothing.
  // Every other publish (a new registration id, or none) is judged as usual:
  // a new registration starts or joins the next round whichever rank
  // publishes first. Publish order cannot tell a new registration from one
  // made for the refused attempt (a rank whose publish arrives after the
  // refusal may be either), so order is never the rule: refusing a rank for
  // publishing before the refused rank left it without a plan.
  absl::Status StaleForRefusedRound(const Job& job, const Daemon& daemon,
                                    const v1::PublishManifestRequest& published,
                                    const std::string& registration) const;
  // A daemon's own refusal of its trainer's registration
  // (PublishManifestRequest .registration_refused): refuses the job's round.
  absl::StatusOr<int64_t> RefuseOwnRegistration(
      Job& job, const v1::PublishManifestRequest& published,
      const std::string& registration);

  const int64_t rebalance_activate_margin_;
  const JobPlanner* const planner_;
  CoordinatorMetrics* const metrics_;
};

}  // namespace muond
