#pragma once
// The versions of a job's NS-home plans and every rule about them, in one
// place (docs/ARCHITECTURE.md "Plans and their versions"):
//
//  * Numbering. The coordinator numbers a job's plans 1, 2, 3, ... strictly
//    increasing. A coordinator that restarted under running daemons learns
//    from their manifests the newest version they hold and the last step they
//    applied (RaiseFloor), numbers its plans above that version and lets its
//    first plan activate after that step (RoundActivationStep), so the
//    daemons keep stepping with their predecessor's plans until every rank
//    can switch together.
//  * Retention. Every holder keeps the newest kPlansKept versions: the
//    coordinator per job, the daemon, the step engine per Muon group. One
//    limit, so a version a domain may agree on is held everywhere or nowhere.
//  * Rounds. A daemon's registration starts a round: plans below the round's
//    first version (the coordinator's answer to the registration) were
//    computed for earlier params and rendezvous keys and are never used.
//  * Activation. Before step s a daemon steps by the newest plan of its
//    round that activates at or before s; when all of them activate later,
//    by the oldest of the round (every rank of a domain received that one
//    too, so all pick the same). The engine is handed every version up to the
//    active one, since the domain's ranks agree each step on the oldest of
//    their newest versions (AgreedPlanVersion).
//
// A plan version's life on a daemon: received (Insert) -> held -> active
// (ActiveAt picked it) -> agreed by the domain (the engine routed a step by
// it) -> evicted (kPlansKept newer versions arrived).
//
// The history is a template over the plan type so that core/ stays free of
// protobuf: the servers hold v1::Plan, tests a plain struct. A plan type has
// `int64_t version() const` and `int64_t activate_at_step() const`.
//
// Not thread-safe: its owner's mutex guards it.
#include <algorithm>
#include <concepts>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace muond {

// Plan versions every holder keeps (see above).
inline constexpr int kPlansKept = 64;

// The highest plan version anyone numbers, holds or routes by (the step
// engine's limit, LayerShardedMuon::kMaxHomesVersion, is this one): versions
// travel in the domain's agreement votes, which have 48 bits for them. The
// coordinator refuses a daemon's known_plan_version above it and Append
// refuses to number past it.
inline constexpr int64_t kMaxPlanVersion = (int64_t(1) << 48) - 1;

// InvalidArgument naming `field` unless 1 <= kept <= kPlansKept: a holder
// that keeps more than the others is of no use (a version the others dropped
// cannot be agreed on), one that keeps fewer fails steps the others accept.
absl::Status ValidatePlansKept(const char* field, int kept);

// The version a step was routed by: the oldest of the versions the domains
// agreed on (`agreed`, one per Muon group; a peer may not hold the newest
// yet), and at most `active`, the version the daemon activated.
int64_t AgreedPlanVersion(int64_t active,
                          const std::map<std::string, int64_t>& agreed);

template <typename P>
concept VersionedPlan = std::copyable<P> && requires(const P& p) {
  { p.version() } -> std::convertible_to<int64_t>;
  { p.activate_at_step() } -> std::convertible_to<int64_t>;
};

template <VersionedPlan Plan>
class PlanHistory {
 public:
  // Whether a held plan can serve the daemon's current params (e.g. it
  // covers every registered group).
  using Usable = std::function<bool(const Plan&)>;

  // Keeps the newest `kept` versions, clamped to [1, kPlansKept] (callers
  // with a configurable limit check it first with ValidatePlansKept).
  explicit PlanHistory(int kept = kPlansKept)
      : kept_(std::clamp(kept, 1, kPlansKept)) {}

  // ---- Numbering (the coordinator) ----

  // Daemons hold versions up to `held_version` and applied steps up to
  // `applied_step` (their manifests' resume fields). Non-zero on a fresh
  // history: the coordinator restarted under running daemons.
  void RaiseFloor(int64_t held_version, int64_t applied_step) {
    floor_ = std::max(floor_, held_version);
    resume_step_ = std::max(resume_step_, applied_step);
  }
  // The latest step any daemon reported with its manifest.
  int64_t resume_step() const { return resume_step_; }

  // The next plan's version: above every held one and above the floor.
  int64_t NextVersion() const {
    const int64_t newest_held = plans_.empty() ? 0 : plans_.rbegin()->first;
    return std::max(newest_held, floor_) + 1;
  }

  // The step a new registration round's plan activates at: 0 (at once; its
  // params have no plan yet), unless this history never planned while the
  // daemons already stepped (a coordinator restart): then `margin` steps
  // after their latest step, so every rank has the plan before it switches.
  int64_t RoundActivationStep(int64_t margin) const {
    return !ever_held_ && resume_step_ > 0 ? resume_step_ + margin : 0;
  }

  // Holds `plan`, which must carry NextVersion() (FailedPrecondition
  // otherwise: versions are strictly increasing), and drops the oldest
  // beyond the limit.
  // ResourceExhausted past kMaxPlanVersion.
  absl::Status Append(Plan plan) {
    if (int64_t(plan.version()) > kMaxPlanVersion) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "plan version ", int64_t(plan.version()), " exceeds the limit ",
          kMaxPlanVersion, " (kMaxPlanVersion); restart the job's daemons"));
    }
    if (int64_t(plan.version()) != NextVersion()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "plan version ", int64_t(plan.version()), " is not the next version ",
          NextVersion(), " (versions are strictly increasing)"));
    }
    Insert(std::move(plan));
    return absl::OkStatus();
  }

  // ---- Receiving (the daemon) ----

  // Holds `plan` and drops the oldest beyond the limit. False (nothing
  // changes) when its version is held already: a version names one plan, the
  // first copy received stays.
  bool Insert(Plan plan) {
    const int64_t version = plan.version();
    if (!plans_.try_emplace(version, std::move(plan)).second) return false;
    ever_held_ = true;
    while (plans_.size() > size_t(kept_)) plans_.erase(plans_.begin());
    return true;
  }

  // ---- Registration rounds (the daemon) ----

  // A new registration: plans below `first_version` (the coordinator's
  // answer to it; 0 = any) belong to earlier rounds and are never used.
  void StartRound(int64_t first_version) { round_start_ = first_version; }
  int64_t round_start() const { return round_start_; }

  // ---- Lookup ----

  bool empty() const { return plans_.empty(); }
  size_t size() const { return plans_.size(); }
  int kept() const { return kept_; }
  // nullptr when not held (never received, or evicted).
  const Plan* Find(int64_t version) const {
    auto it = plans_.find(version);
    return it == plans_.end() ? nullptr : &it->second;
  }
  const Plan* newest() const {
    return plans_.empty() ? nullptr : &plans_.rbegin()->second;
  }
  const Plan* oldest() const {
    return plans_.empty() ? nullptr : &plans_.begin()->second;
  }
  // What a plan watcher that holds `after_version` gets next: the newest
  // plan for a new watcher (after_version <= 0), otherwise the oldest held
  // version above it, not the newest: a daemon must hold every version its
  // domain's ranks may agree on, so a watcher that fell behind a burst of
  // rebalances must not skip one (one further behind than the limit gets the
  // oldest held). nullptr when nothing newer is held.
  const Plan* NextForWatcher(int64_t after_version) const {
    if (plans_.empty() || plans_.rbegin()->first <= after_version) {
      return nullptr;
    }
    if (after_version <= 0) return newest();
    return &plans_.upper_bound(after_version)->second;
  }

  // ---- Activation (the daemon) ----

  // The newest usable plan of the current round; nullptr when none.
  const Plan* NewestOfRound(const Usable& usable) const {
    for (auto it = plans_.rbegin();
         it != plans_.rend() && it->first >= round_start_; ++it) {
      if (usable(it->second)) return &it->second;
    }
    return nullptr;
  }

  // The plan a daemon steps by at step `step` (the rule at the top); nullptr
  // when the round has no usable plan.
  const Plan* ActiveAt(int64_t step, const Usable& usable) const {
    for (auto it = plans_.rbegin();
         it != plans_.rend() && it->first >= round_start_; ++it) {
      if (int64_t(it->second.activate_at_step()) <= step &&
          usable(it->second)) {
        return &it->second;
      }
    }
    for (auto it = plans_.lower_bound(round_start_); it != plans_.end(); ++it) {
      if (usable(it->second)) return &it->second;
    }
    return nullptr;
  }

  // Usable plans of the round with a version in (after, upto], oldest first:
  // what the engine must be handed when the daemon switches from version
  // `after` (0: none yet) to `upto`.
  std::vector<const Plan*> HandOver(int64_t after, int64_t upto,
                                    const Usable& usable) const {
    std::vector<const Plan*> out;
    for (auto it = plans_.upper_bound(std::max(after, round_start_ - 1));
         it != plans_.end() && it->first <= upto; ++it) {
      if (usable(it->second)) out.push_back(&it->second);
    }
    return out;
  }

 private:
  int kept_;
  std::map<int64_t, Plan> plans_;  // by version
  bool ever_held_ = false;
  int64_t floor_ = 0;
  int64_t resume_step_ = 0;
  int64_t round_start_ = 0;
};

}  // namespace muond
