#pragma once
// The optimizer instances one daemon hosts (docs/ARCHITECTURE.md
// "Processes"; server/README.md "Optimizer instances"). Each instance is its
// own DaemonCore (registration, engine, plans, state, communicators) under a
// name: "" is the default one, there from the start (requests without a name
// reach it, as before instances existed); a named one is made (and joined to
// its own job on the coordinator) by the first RegisterParams naming it and
// removed when it no longer holds a registration.
//
// Readiness, one rule: the daemon can step when at least one instance holds
// a registration and every instance that does can step. The table keeps
// that value and reports each change to `on_serving` under its lock (the
// grpc.health.v1 status follows it); Health() without a name answers the
// same value as has_plan.
//
// Thread-safety: all methods are thread-safe.
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/daemon_core.h"

namespace muond {

// Instances a daemon hosts at once, the default one included: each holds its
// communicators, a plan stream and mapped memory.
inline constexpr int kMaxOptimizerInstances = 16;

// One instance: its core and what feeds it plans.
struct OptimizerInstance {
  std::shared_ptr<DaemonCore> core;
  // Its job on the coordinator (InstanceJobId), for messages.
  std::string job;
  // Joins the instance's job on the coordinator, retrying a refusal that may
  // pass for at most `timeout` (capped by the daemon's coordinator timeout),
  // and starts its plan stream (for a named instance the table calls it
  // when making it); empty: nothing to join.
  std::function<absl::Status(absl::Duration timeout)> start;
  // Ends plan delivery to `core`; called before `core` goes away.
  std::function<void()> stop;
  // What must outlive `core` (its coordinator link): released after it.
  std::shared_ptr<void> owned;

  ~OptimizerInstance();
};

// Makes instance `name` ("" the default); its DaemonConfig::on_readiness must
// be `on_readiness`.
using InstanceFactory =
    std::function<absl::StatusOr<std::unique_ptr<OptimizerInstance>>(
        const std::string& name, std::function<void(bool)> on_readiness)>;

class OptimizerTable {
 public:
  // Makes the default instance at once (a failure is fatal: check ok()).
  // `on_serving` (may be empty) hears every change of the daemon's readiness.
  OptimizerTable(InstanceFactory factory, std::function<void(bool)> on_serving,
                 int max_instances = kMaxOptimizerInstances);
  // A table of `core` alone (not owned; it must outlive the table): a named
  // instance is refused (tests and tools that drive one core).
  explicit OptimizerTable(DaemonCore* core);
  ~OptimizerTable();

  // The default instance could be made (else why not).
  absl::Status ok() const { return made_default_; }
  // The default instance (never null once ok()).
  std::shared_ptr<OptimizerInstance> Default();

  // RegisterParams on instance request.optimizer(), made first when new
  // (InvalidArgument for a bad name; ResourceExhausted naming the cap, the
  // live instances and their owners when the daemon hosts the most it may;
  // the coordinator's refusal of the instance's Join, naming the instance,
  // its coordinator job and the fix). A new instance joins the coordinator
  // with no table-wide lock held, so a slow or refused join delays only
  // registrations of that name; the join ends before `deadline` (the RPC's)
  // so the trainer hears why rather than a bare deadline.
  absl::StatusOr<v1::RegisterParamsResponse> Register(
      const v1::RegisterParamsRequest& request,
      const std::function<bool()>& cancelled,
      absl::Time deadline = absl::InfiniteFuture());
  // UnregisterParams on instance request.optimizer(); a named instance
  // left without a registration is removed (its engine, communicators and
  // mappings released). Unregistering an instance that is not there is OK,
  // as unregistering nothing is.
  absl::Status Unregister(const v1::UnregisterParamsRequest& request);
  // Instance `name`: InvalidArgument for a bad name, NotFound naming it and
  // the live instances when there is none of that name.
  absl::StatusOr<std::shared_ptr<OptimizerInstance>> Find(
      const std::string& name);

  // The instance's status and the names of every instance.
  absl::StatusOr<v1::GetStatusResponse> Status(const std::string& name);
  // Without request.optimizer: the daemon (has_plan: the readiness rule
  // above); with it: that instance (one not made yet: no plan, no error).
  // serving: false from Shutdown on.
  absl::StatusOr<v1::HealthResponse> Health(const v1::HealthRequest& request);
  // Not serving for good (shutdown began).
  void Shutdown();
  std::vector<std::string> Names();

 private:
  struct Entry {
    std::shared_ptr<OptimizerInstance> instance;
    uint64_t serial = 0;  // tells a removed instance's late report apart
    bool ready = false;   // its readiness as it last reported
  };
  // Instance `name`, made and started when there is none: one thread makes
  // a name (pending_) while others of that name wait, until `deadline`.
  absl::StatusOr<std::shared_ptr<OptimizerInstance>> Make(
      const std::string& name, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Makes and starts instance `name` (no lock held).
  absl::StatusOr<std::unique_ptr<OptimizerInstance>> Build(
      const std::string& name, uint64_t serial, absl::Time deadline);
  std::function<void(bool)> ReadinessOf(uint64_t serial);
  void OnReadiness(uint64_t serial, bool ready);
  // Recomputes the readiness rule; reports a change to on_serving_.
  void Refresh() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes named instance `name` when it holds no registration.
  void RemoveIfIdle(const std::string& name);
  std::shared_ptr<OptimizerInstance> Lookup(const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  // "'' (client 'a'), 'opt-2' (no registration)": the live instances.
  std::string Describe() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const InstanceFactory factory_;
  const std::function<void(bool)> on_serving_;
  const int max_instances_;
  // The table of one core it does not own: that core reports no readiness
  // to the table, which asks it instead.
  const bool live_readiness_ = false;
  absl::Status made_default_;
  // Held to remove an instance (writer) and around a registration (reader),
  // so an instance is never removed under a registration.
  absl::Mutex lifecycle_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  // Names being made (joining the coordinator); they count towards the cap.
  std::set<std::string> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 0;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace muond
