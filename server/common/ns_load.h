#pragma once
// A job rank's share of a plan's Newton-Schulz cost: the daemon's
// muond_ns_load and the coordinator's muond_coordinator_ns_load (one rule,
// so the two agree).
#include <string>
#include <utility>
#include <vector>

#include "muond/v1/muond.pb.h"

namespace muond {

// The groups one job rank holds, each with its place in the group's domain
// (the rank's registration, or the manifest it published).
using HeldGroups = std::vector<std::pair<std::string, v1::Domain>>;

// sum over `held` of the group's GroupPlan.rank_load at the rank's flat
// domain rank ((d * G + g) * T + t), divided by the sum of every group's
// rank_load over every domain rank: in [0, 1], and the shares of a job's
// ranks add up to 1. 0 when the plan has no NS cost (AdamW only, or no plan).
// Groups of `held` that the plan does not cover count 0.
double NsLoadShare(const v1::Plan& plan, const HeldGroups& held);

}  // namespace muond
