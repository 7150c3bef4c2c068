#pragma once
// Building the daemon's step engine on a thread of its own, so the daemon
// stays responsive while communicators wait for their peers
// (docs/ARCHITECTURE.md "Threads").
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/comm/communicator.h"
#include "core/step/layer_sharded_muon.h"
#include "muond/v1/muond.pb.h"
#include "server/daemon/registration.h"

namespace muond {

// The step engine and what it runs on. Members are destroyed bottom-up: the
// engine first, then its backends (streams), then the communicators.
struct StepEngine {
  std::vector<std::unique_ptr<Communicator>> communicators;
  std::vector<std::shared_ptr<Backend>> backends;
  std::unique_ptr<LayerShardedMuon> muon;
};

// Creates the engine for `registration` under plan `plan` (communicators
// rendezvous under a prefix naming the plan version and plan.comm_epoch(),
// the job's communicator epoch, so every rank of a domain meets its peers,
// and a rebuild after a failure meets them under fresh keys). Blocks until
// peers arrive or a timeout, or until `abandoned()` turns true (the
// registration it is for is gone, or the daemon shuts down): then it should
// stop waiting and return Cancelled, so a trainer that re-registers is not kept
// waiting for a rendezvous peers have left. A factory owns (or shares)
// everything it uses, e.g. the rendezvous store: an abandoned build may still
// run after the daemon core is gone.
using EngineFactory = std::function<absl::StatusOr<std::unique_ptr<StepEngine>>(
    const Registration& registration, const v1::Plan& plan,
    const std::function<bool()>& abandoned)>;

// Runs engine builds, each on a thread this object owns. A build shares
// ownership of everything it touches (a copy of the factory, the
// registration, the plan, its cancellation flag and its result) and never
// points at the daemon core, so an abandoned build may run on while the
// daemon moves on: the store's waits and Gloo's connects stop within a
// slice once it is cancelled, but a call that cannot be stopped (a backend's
// init with a peer that gave up) would otherwise hold the next registration
// (or a shutdown) for the whole communicator timeout.
//
// Thread-safety: Build is called from one thread at a time (the daemon's
// builder loop).
class EngineBuilder {
 public:
  explicit EngineBuilder(EngineFactory factory);
  // Joins every abandoned build that has ended. One still stuck in a connect
  // is detached: it holds shared ownership of all it touches, and a shutdown
  // must not wait out a communicator timeout.
  ~EngineBuilder();
  EngineBuilder(const EngineBuilder&) = delete;
  EngineBuilder& operator=(const EngineBuilder&) = delete;

  // Builds the engine for `registration` under `plan` and returns the
  // factory's result; nullopt once `abandon()` (polled every 100 ms) turns
  // true: the build is cancelled and left to end in the background (its
  // result is dropped; the thread is joined at the next Build or at
  // destruction).
  std::optional<absl::StatusOr<std::unique_ptr<StepEngine>>> Build(
      std::shared_ptr<const Registration> registration, const v1::Plan& plan,
      const std::function<bool()>& abandon);

  // Abandoned builds whose thread has not been joined yet.
  int abandoned_builds() const { return int(abandoned_.size()); }

 private:
  struct Pending;
  struct Running {
    std::thread thread;
    std::shared_ptr<Pending> pending;
  };
  // Joins the abandoned builds that have ended.
  void JoinEnded();

  const EngineFactory factory_;
  std::vector<Running> abandoned_;
};

}  // namespace muond
