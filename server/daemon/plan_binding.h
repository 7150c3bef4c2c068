#pragma once
// What a plan from the coordinator means for this daemon's registration:
// whether it covers the registered groups, the NS homes it hands the engine,
// and this rank's place in each group's domain (for the ns_load metric).
#include "absl/status/status.h"
#include "core/step/layer_sharded_muon.h"
#include "muond/v1/muond.pb.h"
#include "server/common/ns_load.h"
#include "server/daemon/registration.h"

namespace muond {

// True when `plan` has every registered group, and each Muon group's plan
// has one home per registered param. The plan covers every group of the
// job; other daemons' groups (e.g. the 1x1 groups a single trainer gives
// each daemon) are not this daemon's to match.
bool PlanCoversRegistration(const v1::Plan& plan,
                            const Registration& registration);

// Hands the plan's NS homes of the registration's Muon groups to the engine
// (LayerShardedMuon::SetHomes); its error prefixed with the plan version.
absl::Status SetEngineHomes(const v1::Plan& plan,
                            const Registration& registration,
                            LayerShardedMuon& muon);

// This rank's place in each of its groups' domains (for NsLoadShare).
HeldGroups HeldGroupsOf(const Registration& registration);

}  // namespace muond
