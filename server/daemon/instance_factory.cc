#include "server/daemon/instance_factory.h"

#include <algorithm>
#include <utility>

#include "server/common/job_id.h"
#include "server/daemon/coordinator_link.h"
#include "server/daemon/memory_mapper.h"

namespace muond {
namespace {

std::unique_ptr<HandleOpener> MakeOpener(const InstanceSettings& settings) {
  std::unique_ptr<HandleOpener> opener =
      settings.device >= 0 ? MakeCudaHandleOpener(settings.device)
                           : std::make_unique<HandleOpener>();
  opener->set_allow_foreign_shm(settings.allow_foreign_shm);
  return opener;
}

absl::StatusOr<std::unique_ptr<OptimizerInstance>> MakeInstance(
    const InstanceSettings& settings, const std::string& name,
    std::function<void(bool)> on_readiness) {
  const std::string job = InstanceJobId(settings.join.job_id(), name);
  v1::JoinRequest join = settings.join;
  join.set_job_id(job);
  // Shared with the engine factory: an abandoned engine build may outlive
  // the instance (engine_builder.h).
  auto link = std::make_shared<GrpcCoordinatorLink>(
      settings.coordinator, join, settings.coordinator_credentials);
  DaemonConfig config = settings.config;
  config.on_readiness = std::move(on_readiness);
  config.optimizer = name;
  EngineOptions engine = settings.engine;
  engine.job_id = job;
  auto instance = std::make_unique<OptimizerInstance>();
  instance->job = job;
  instance->core =
      std::make_shared<DaemonCore>(std::move(config), MakeOpener(settings),
                                   link.get(), MakeEngineFactory(engine, link));
  // The link's threads end (stop) before the core goes away.
  DaemonCore* core = instance->core.get();
  const absl::Duration most = settings.coordinator_timeout;
  instance->start = [link, core, most](absl::Duration timeout) {
    return link->Start([core](const v1::Plan& plan) { core->OnPlan(plan); },
                       std::min(timeout, most));
  };
  instance->stop = [link] { link->Stop(); };
  instance->owned = link;
  return instance;
}

}  // namespace

InstanceFactory MakeInstanceFactory(InstanceSettings settings) {
  return [settings = std::move(settings)](
             const std::string& name, std::function<void(bool)> on_readiness) {
    return MakeInstance(settings, name, std::move(on_readiness));
  };
}

}  // namespace muond
