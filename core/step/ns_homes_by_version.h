#pragma once
// The NS homes one Muon group holds, by plan version: the newest kCapacity
// versions SetHomes gave it. Each step the group's domain agrees on one
// version (domain_agreement.h) and routes by the homes stored under it, so a
// rank can follow its domain back to a version an earlier plan set while a
// newer plan has reached only some ranks.
//
// Retention is the one rule of core/plan/plan_history.h: every holder of plan
// versions (coordinator, daemon, this store) keeps the newest kPlansKept, so
// a version the domain may agree on is held everywhere or nowhere. Not
// thread-safe (the engine serializes SetHomes and Step).
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/status.h"
#include "core/plan/plan_history.h"
#include "core/plan/planner.h"

namespace muond {

class NsHomesByVersion {
 public:
  // Versions kept; an older one is dropped when a newer one arrives.
  static constexpr size_t kCapacity = kPlansKept;

  // Holds `homes` as `version` (>= 1, checked by the caller). A version
  // already held must name the same homes: InvalidArgument otherwise
  // (versions name one plan), and nothing changes.
  absl::Status Put(int64_t version, std::vector<NsHome> homes);

  // The homes of `version`, or null when it is not held.
  const std::vector<NsHome>* Find(int64_t version) const;

  // The newest and oldest held version; 0 when none is held.
  int64_t newest() const;
  int64_t oldest() const;
  size_t size() const { return by_version_.size(); }

 private:
  std::map<int64_t, std::vector<NsHome>> by_version_;
};

}  // namespace muond
