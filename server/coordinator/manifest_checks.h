#pragma once
// The rules a published manifest must meet, as pure functions: its own shape
// (names, domains, wire shapes, resume fields) and its agreement with the
// manifests the job's other ranks published (same domain sizes, distinct
// coordinates, the same params and hyperparameters across a domain).
// Messages name the group, the param and both ranks.
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "google/protobuf/repeated_field.h"
#include "muond/v1/muond.pb.h"
#include "server/coordinator/job.h"

namespace muond {

// "[r, c]": how messages print a shape.
std::string ShapeString(const google::protobuf::RepeatedField<int64_t>& s);

// "GxT", or "DxGxT" with a DP axis: how messages name a domain's sizes.
std::string DomainText(const v1::Domain& d);

// A publish's checks of the request alone. InvalidArgument: empty or
// duplicate group or param names, an algorithm out of the enum, a domain
// whose coordinates it does not contain, a shape that is not 1-D or 2-D with
// positive dims (local_shape may have 0 rows), negative resume fields,
// known_plan_version past kMaxPlanVersion, or a last_step_id that overflows
// with the activation margin a restarted coordinator adds.
absl::Status ValidatePublishFields(const v1::PublishManifestRequest& published,
                                   int64_t rebalance_activate_margin);

// Checks `request` against the manifests the job's other ranks published;
// OK when consistent (maybe incomplete). InvalidArgument: another domain
// for the same group, two ranks claiming the same coordinates, a param that
// differs from an earlier rank of the domain, a differing hyperparameter.
absl::Status CheckAgainstPeers(const Job& job,
                               const v1::PublishManifestRequest& request);

}  // namespace muond
