#include "server/daemon/optimizer_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/echo.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "server/common/job_id.h"

namespace muond {
namespace {

constexpr char kField[] = "optimizer";

// "optimizer 'x'", or "the default optimizer" for "".
std::string Named(const std::string& name) {
  return name.empty() ? "the default optimizer"
                      : absl::StrCat("optimizer '", name, "'");
}

absl::Status CheckName(const std::string& name) {
  if (name.empty()) return absl::OkStatus();
  return CheckOptimizerName(kField, name);
}

// absl::Condition's predicate: `name` is not being made.
struct NotPending {
  const std::set<std::string>* pending;
  const std::string* name;
  bool operator()() const { return pending->count(*name) == 0; }
};

}  // namespace

OptimizerInstance::~OptimizerInstance() {
  if (stop) stop();
  core.reset();
}

OptimizerTable::OptimizerTable(InstanceFactory factory,
                               std::function<void(bool)> on_serving,
                               int max_instances)
    : factory_(std::move(factory)),
      on_serving_(std::move(on_serving)),
      max_instances_(max_instances) {
  absl::StatusOr<std::shared_ptr<OptimizerInstance>> made =
      Make("", absl::InfiniteFuture());
  made_default_ = made.status();
}

OptimizerTable::OptimizerTable(DaemonCore* core)
    : max_instances_(1), live_readiness_(true) {
  auto instance = std::make_shared<OptimizerInstance>();
  instance->core = std::shared_ptr<DaemonCore>(core, [](DaemonCore*) {});
  absl::MutexLock lock(&mu_);
  entries_[""] = Entry{std::move(instance), next_serial_++, false};
}

OptimizerTable::~OptimizerTable() {
  std::map<std::string, Entry> entries;
  {
    absl::MutexLock lock(&mu_);
    entries.swap(entries_);
  }
  // Outside mu_: a core going away reports its readiness (OnReadiness).
  entries.clear();
}

std::function<void(bool)> OptimizerTable::ReadinessOf(uint64_t serial) {
  return [this, serial](bool ready) { OnReadiness(serial, ready); };
}

void OptimizerTable::OnReadiness(uint64_t serial, bool ready) {
  absl::MutexLock lock(&mu_);
  for (auto& [name, entry] : entries_) {
    if (entry.serial == serial) entry.ready = ready;
  }
  Refresh();
}

absl::StatusOr<std::shared_ptr<OptimizerInstance>> OptimizerTable::Make(
    const std::string& name, absl::Time deadline) {
  if (!factory_) {
    return absl::UnimplementedError(absl::StrCat(
        Named(name), ": this server hosts the default optimizer only"));
  }
  uint64_t serial;
  {
    absl::MutexLock lock(&mu_);
    NotPending not_pending{&pending_, &name};
    if (!mu_.AwaitWithDeadline(absl::Condition(&not_pending), deadline)) {
      return absl::UnavailableError(absl::StrCat(
          Named(name),
          " is still joining its job on the coordinator for another "
          "registration of that name; retry"));
    }
    if (auto it = entries_.find(name); it != entries_.end()) {
      return it->second.instance;
    }
    if (int(entries_.size() + pending_.size()) >= max_instances_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cannot make ", Named(name), ": this daemon hosts ",
          entries_.size() + pending_.size(),
          " optimizer instances, the most it may (", max_instances_,
          "): ", Describe(), "; close (unregister) one of them first"));
    }
    pending_.insert(name);
    serial = next_serial_++;
  }
  absl::StatusOr<std::unique_ptr<OptimizerInstance>> built =
      Build(name, serial, deadline);
  std::shared_ptr<OptimizerInstance> instance;
  if (built.ok()) instance = std::move(*built);
  {
    absl::MutexLock lock(&mu_);
    pending_.erase(name);
    if (instance != nullptr) {
      entries_[name] = Entry{instance, serial, false};
      Refresh();
    }
  }
  // A failed instance (if any) went away in `built`, outside mu_: a core's
  // end reports its readiness (OnReadiness).
  if (!built.ok()) return built.status();
  LOG_IF(INFO, !name.empty()) << Named(name) << " made";
  return instance;
}

absl::StatusOr<std::unique_ptr<OptimizerInstance>> OptimizerTable::Build(
    const std::string& name, uint64_t serial, absl::Time deadline) {
  ASSIGN_OR_RETURN(std::unique_ptr<OptimizerInstance> instance,
                   factory_(name, ReadinessOf(serial)));
  if (name.empty() || !instance->start) return instance;
  // End before the trainer's deadline, keeping a margin for the answer.
  const absl::Duration left = deadline - absl::Now();
  const absl::Duration timeout = std::max(
      left - std::min(absl::Seconds(1), left / 4), absl::Milliseconds(100));
  absl::Status started = instance->start(timeout);
  if (started.ok()) return instance;
  return absl::Status(
      started.code() == absl::StatusCode::kDeadlineExceeded
          ? absl::StatusCode::kUnavailable
          : started.code(),
      absl::StrCat(
          Named(name), " could not join its job '", instance->job,
          "' on the coordinator: ", started.message(),
          ". Other daemons hold that job when another live trainer of the "
          "same job made an optimizer of the same name: give this one "
          "another name (muond.torch.Muon(name=...)) or stop the other "
          "trainer; this daemon's other optimizers are not affected"));
}

std::shared_ptr<OptimizerInstance> OptimizerTable::Default() {
  return Lookup("");
}

std::shared_ptr<OptimizerInstance> OptimizerTable::Lookup(
    const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : it->second.instance;
}

absl::StatusOr<std::shared_ptr<OptimizerInstance>> OptimizerTable::Find(
    const std::string& name) {
  RETURN_IF_ERROR(CheckName(name));
  if (std::shared_ptr<OptimizerInstance> found = Lookup(name)) return found;
  absl::MutexLock lock(&mu_);
  return absl::NotFoundError(absl::StrCat(
      Named(name),
      " is not on this daemon (RegisterParams makes it); it hosts ",
      Describe()));
}

absl::StatusOr<v1::RegisterParamsResponse> OptimizerTable::Register(
    const v1::RegisterParamsRequest& request,
    const std::function<bool()>& cancelled, absl::Time deadline) {
  const std::string& name = request.optimizer();
  RETURN_IF_ERROR(CheckName(name));
  absl::StatusOr<v1::RegisterParamsResponse> outcome;
  while (true) {
    {
      absl::ReaderMutexLock life(&lifecycle_);
      if (std::shared_ptr<OptimizerInstance> found = Lookup(name)) {
        outcome = found->core->Register(request, cancelled);
        break;
      }
    }
    RETURN_IF_ERROR(Make(name, deadline).status());
  }
  {
    absl::MutexLock lock(&mu_);
    Refresh();
  }
  if (!outcome.ok()) RemoveIfIdle(name);
  return outcome;
}

absl::Status OptimizerTable::Unregister(
    const v1::UnregisterParamsRequest& request) {
  const std::string& name = request.optimizer();
  RETURN_IF_ERROR(CheckName(name));
  std::shared_ptr<OptimizerInstance> found = Lookup(name);
  if (found == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(found->core->Unregister(request));
  found.reset();
  RemoveIfIdle(name);
  absl::MutexLock lock(&mu_);
  Refresh();
  return absl::OkStatus();
}

void OptimizerTable::RemoveIfIdle(const std::string& name) {
  if (name.empty()) return;  // the default instance stays
  std::shared_ptr<OptimizerInstance> removed;
  {
    absl::MutexLock life(&lifecycle_);
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(name);
    if (it == entries_.end() || it->second.instance->core->Owner()) return;
    removed = std::move(it->second.instance);
    entries_.erase(it);
    Refresh();
  }
  LOG(INFO) << Named(name) << " removed";
  // Outside the locks: the core's end reports its readiness (OnReadiness).
  removed.reset();
}

void OptimizerTable::Refresh() {
  bool any = false;
  bool all_ready = true;
  for (auto& [name, entry] : entries_) {
    if (!entry.instance->core->Owner()) continue;
    any = true;
    const bool ready = live_readiness_
                           ? entry.instance->core->Health().has_plan()
                           : entry.ready;
    all_ready = all_ready && ready;
  }
  const bool serving = !shut_down_ && any && all_ready;
  if (serving == serving_) return;
  serving_ = serving;
  if (on_serving_) on_serving_(serving);
}

std::string OptimizerTable::Describe() {
  std::vector<std::string> parts;
  for (auto& [name, entry] : entries_) {
    const std::optional<std::string> owner = entry.instance->core->Owner();
    parts.push_back(absl::StrCat(
        "'", name, "' (",
        owner ? absl::StrCat("client '", Echo(*owner), "'") : "no registration",
        ")"));
  }
  return absl::StrJoin(parts, ", ");
}

std::vector<std::string> OptimizerTable::Names() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (auto& [name, entry] : entries_) names.push_back(name);
  return names;
}

absl::StatusOr<v1::GetStatusResponse> OptimizerTable::Status(
    const std::string& name) {
  ASSIGN_OR_RETURN(std::shared_ptr<OptimizerInstance> found, Find(name));
  v1::GetStatusResponse status = found->core->Status();
  status.set_optimizer(name);
  for (const std::string& n : Names()) status.add_optimizers(n);
  return status;
}

absl::StatusOr<v1::HealthResponse> OptimizerTable::Health(
    const v1::HealthRequest& request) {
  if (request.has_optimizer()) {
    RETURN_IF_ERROR(CheckName(request.optimizer()));
    // An instance not made yet answers as one without a registration: a
    // trainer waits for the daemon before its RegisterParams makes it.
    std::shared_ptr<OptimizerInstance> found = Lookup(request.optimizer());
    v1::HealthResponse health;
    if (found != nullptr) health = found->core->Health();
    absl::MutexLock lock(&mu_);
    health.set_serving(!shut_down_);
    if (shut_down_) health.set_has_plan(false);
    return health;
  }
  absl::MutexLock lock(&mu_);
  if (live_readiness_) Refresh();
  v1::HealthResponse health;
  health.set_serving(!shut_down_);
  health.set_has_plan(serving_);
  for (auto& [name, entry] : entries_) {
    const std::string error = entry.instance->core->Health().engine_error();
    if (error.empty()) continue;
    health.set_engine_error(
        name.empty() ? error : absl::StrCat(Named(name), ": ", error));
    break;
  }
  return health;
}

void OptimizerTable::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;
  Refresh();
}

}  // namespace muond
