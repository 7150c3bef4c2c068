#include "server/daemon/engine_builder.h"

#include <atomic>
#include <utility>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace muond {

// What a build thread and the builder share.
struct EngineBuilder::Pending {
  std::atomic<bool> cancelled{false};
  absl::Notification done;
  absl::StatusOr<std::unique_ptr<StepEngine>> result;
};

EngineBuilder::EngineBuilder(EngineFactory factory)
    : factory_(std::move(factory)) {}

EngineBuilder::~EngineBuilder() {
  for (Running& build : abandoned_) {
    build.pending->cancelled.store(true);
    if (build.pending->done.HasBeenNotified()) {
      build.thread.join();
    } else {
      build.thread.detach();  // owns what it touches (see the class comment)
    }
  }
}

void EngineBuilder::JoinEnded() {
  std::vector<Running> running;
  for (Running& build : abandoned_) {
    if (build.pending->done.HasBeenNotified()) {
      build.thread.join();
    } else {
      running.push_back(std::move(build));
    }
  }
  abandoned_ = std::move(running);
}

std::optional<absl::StatusOr<std::unique_ptr<StepEngine>>> EngineBuilder::Build(
    std::shared_ptr<const Registration> registration, const v1::Plan& plan,
    const std::function<bool()>& abandon) {
  JoinEnded();
  auto pending = std::make_shared<Pending>();
  std::thread thread([factory = factory_, pending, registration, plan] {
    pending->result = factory(*registration, plan,
                              [pending] { return pending->cancelled.load(); });
    pending->done.Notify();
  });
  while (
      !pending->done.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
    if (abandon()) {
      pending->cancelled.store(true);
      abandoned_.push_back({std::move(thread), std::move(pending)});
      return std::nullopt;
    }
  }
  thread.join();
  return std::move(pending->result);
}

}  // namespace muond
