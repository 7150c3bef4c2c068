#pragma once
// The fixture of DaemonCore's in-process tests: a fake coordinator link, a
// fake step engine and a registration over a real shm region, so every bad
// input can be shown to get a status naming the param/field and change
// nothing. Each daemon_core_*_test includes it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "client/cpp/client.h"
#include "client/cpp/shm_region.h"
#include "core/common/error_reason.h"
#include "server/common/operator_id.h"
#include "server/common/safetensors.h"
#include "server/daemon/daemon_core.h"

namespace muond::daemon_core_test {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

class FakeLink : public CoordinatorLink {
 public:
  absl::Status PublishManifest(const v1::PublishManifestRequest& m) override {
    manifests.push_back(m);
    return publish_status;
  }
  absl::StatusOr<int64_t> PublishRegistration(
      const v1::PublishManifestRequest& m) override {
    absl::Status st = PublishManifest(m);
    if (!st.ok()) return st;
    if (during_publish) during_publish();
    return round_version;
  }
  absl::Status PublishRefusal(const std::string& reason) override {
    refusals.push_back(reason);
    return absl::OkStatus();
  }
  void ReportTimings(const v1::ReportTimingsRequest& r) override {
    reports.push_back(r);
  }
  std::vector<std::string> refusals;  // PublishRefusal's reasons
  int64_t round_version = 0;  // what the coordinator answers a registration
  std::vector<v1::PublishManifestRequest> manifests;
  std::vector<v1::ReportTimingsRequest> reports;
  absl::Status publish_status;
  // Runs inside a successful publish (a plan stream message overtaking it).
  std::function<void()> during_publish;
};

// Adds 1 to the first element of every param per step; records homes.
class FakeMuon : public LayerShardedMuon {
 public:
  explicit FakeMuon(std::vector<float*> firsts) : firsts_(std::move(firsts)) {}
  absl::Status SetHomes(const std::string& group, std::vector<NsHome> homes,
                        int64_t version) override {
    homes_set.push_back({group, homes});
    versions_set.push_back(version);
    return absl::OkStatus();
  }
  absl::StatusOr<StepResult> RunStep(const StepInputs& inputs) override {
    // The daemon's own refusals reach the engine, which votes on them.
    if (!inputs.refusal.ok()) return inputs.refusal;
    // A single-rank job's replay vote is a replay: nothing is applied.
    if (inputs.replay) return StepResult{};
    skip_params = inputs.skip_params;
    overrides = inputs.overrides;
    for (float* f : firsts_) *f += 1;
    StepResult r;
    r.timings.total_us = 7;
    if (agreed_version) r.homes_versions["muon"] = *agreed_version;
    return r;
  }
  absl::StatusOr<std::map<std::string, std::vector<float>>> ExportState()
      const override {
    return state;
  }
  // Refuses kUnholdable, as a bf16 engine refuses what rounds to inf.
  static constexpr float kUnholdable = 999.0f;
  absl::Status CheckImportState(
      const std::map<std::string, std::vector<float>>& s) const override {
    for (const auto& [key, values] : s) {
      for (float v : values) {
        if (v == kUnholdable) {
          return absl::InvalidArgumentError("state entry '" + key +
                                            "' holds a value its dtype cannot");
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status ImportState(
      const std::map<std::string, std::vector<float>>& s) override {
    if (absl::Status st = CheckImportState(s); !st.ok()) return st;
    state = s;
    return absl::OkStatus();
  }
  std::map<std::string, std::vector<float>> state = {
      {"w.momentum", std::vector<float>(8, 0.5f)},
      {"v.momentum", std::vector<float>(8, -1.0f)}};
  int64_t state_bytes() const override { return 0; }
  int64_t peak_transient_bytes() const override { return 0; }
  int64_t ns_workspace_bytes() const override { return 0; }
  int64_t peak_ns_workspace_bytes() const override { return 0; }
  std::vector<StateStorageBytes> state_bytes_by_storage() const override {
    return storage;
  }
  // What the engine reports of its state (a registration's groups asked for
  // bf16 state on the device and fp32 on the host).
  std::vector<StateStorageBytes> storage = {
      {StateLocation::kDevice, DType::kBFloat16, 96},
      {StateLocation::kHost, DType::kFloat32, 320}};
  std::vector<std::pair<std::string, std::vector<NsHome>>> homes_set;
  std::vector<int64_t> versions_set;
  // The last applied step's skip_params and overrides.
  std::set<std::string> skip_params;
  StepOverrides overrides;
  // The homes version the domain "agreed" on (unset: none reported).
  std::optional<int64_t> agreed_version;

 private:
  std::vector<float*> firsts_;
};

// The fixture's registration for `client`: group "muon" in a 2x2 domain at
// (0, 0) over `region`: w (8x4 full, column-parallel GTP+TP: local 2x4) at
// offset 0, its grad at 256; v (4x8 row-parallel: local 2x4 as a column
// block of a 2x8 buffer) at 512, grad at 768.
inline v1::RegisterParamsRequest TwoByTwoRequest(const ShmRegion& region,
                                                 const std::string& client) {
  v1::RegisterParamsRequest r;
  r.set_job_id("job");
  r.set_client_id(client);
  *r.add_regions() = HostRegion(region);
  v1::ParamGroup* g = r.add_groups();
  g->set_name("muon");
  g->set_algorithm(v1::ALGORITHM_MUON);
  g->mutable_muon()->set_lr(0.02);
  g->mutable_domain()->set_name("dense");
  g->mutable_domain()->set_gtp_size(2);
  g->mutable_domain()->set_tp_size(2);
  char* base = static_cast<char*>(region.data());
  v1::ShardTags col;
  col.set_tensor_model_parallel(true);
  col.set_partition_dim(0);
  col.set_is_gtp_weight_remat(true);
  *g->add_params() =
      MakeParam("w", {8, 4}, *HostRef(region, base, v1::DTYPE_FP32, {2, 4}),
                *HostRef(region, base + 256, v1::DTYPE_FP32, {2, 4}), col);
  v1::ShardTags row = col;
  row.set_partition_dim(1);
  *g->add_params() = MakeParam(
      "v", {4, 8}, *HostRef(region, base + 512, v1::DTYPE_FP32, {2, 4}, {8, 1}),
      *HostRef(region, base + 768, v1::DTYPE_FP32, {2, 4}, {8, 1}), row);
  return r;
}

// The token the fixture's daemon derives its operator id from.
inline constexpr char kJobToken[] = "job-token";

class DaemonCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    name_ = "/muond-daemon-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
    region_ = *ShmRegion::Create(name_, 4096);
    DaemonConfig config;
    config.job_id = "job";
    config.rank = 0;
    config.world_size = 4;
    config.operator_client_id = OperatorClientId(kJobToken);
    config.metrics = &metrics_;
    // The stale-transaction test cannot wait kPendingTransactionMaxAge.
    if (name_.find("Stale") != std::string::npos) {
      config.pending_transaction_max_age = absl::Milliseconds(200);
    }
    // As in the server: every test runs with the readiness thread.
    config.on_readiness = [this](bool ready) {
      absl::MutexLock lock(&readiness_mu_);
      readiness_.push_back(ready);
    };
    core_ = std::make_unique<DaemonCore>(
        config, std::make_unique<HandleOpener>(), &link_,
        [this](const Registration& reg, const v1::Plan&,
               const std::function<bool()>& abandoned)
            -> absl::StatusOr<std::unique_ptr<StepEngine>> {
          if (fail_builds_) {
            return absl::DeadlineExceededError("rendezvous: rank 1 never came");
          }
          if (stuck_builds_) return StuckUntilReleased();
          if (hold_builds_) return HoldUntilAbandoned(abandoned);
          std::vector<float*> firsts;
          for (const BoundGroup& g : reg.groups) {
            for (const BoundParam& p : g.params) {
              firsts.push_back(static_cast<float*>(p.param.data));
            }
          }
          auto engine = std::make_unique<StepEngine>();
          auto muon = std::make_unique<FakeMuon>(firsts);
          fake_ = muon.get();
          engine->muon = std::move(muon);
          return engine;
        });
  }

  v1::RegisterParamsRequest Valid() {
    return TwoByTwoRequest(*region_, "trainer0");
  }

  v1::Plan PlanFor(int64_t version, int64_t activate_at, int home_g) {
    v1::Plan p;
    p.set_job_id("job");
    p.set_version(version);
    p.set_activate_at_step(activate_at);
    v1::GroupPlan* g = p.add_groups();
    g->set_group("muon");
    for (int i = 0; i < 2; ++i) {
      v1::NsHome* h = g->add_homes();
      h->set_g(home_g);
      h->set_t(i);
    }
    return p;
  }

  void ExpectRefused(const v1::RegisterParamsRequest& r, absl::StatusCode code,
                     const std::string& needle) {
    absl::StatusOr<v1::RegisterParamsResponse> got = core_->Register(r);
    EXPECT_EQ(got.status().code(), code) << got.status();
    EXPECT_THAT(got.status().message(), HasSubstr(needle));
    EXPECT_EQ(core_->Status().num_params(), 0);
  }

  template <typename Request = v1::SaveStateRequest>
  static Request StateReq(const std::string& path,
                          const std::string& client = "trainer0") {
    Request r;
    r.set_path(path);
    r.set_job_id("job");
    r.set_client_id(client);
    return r;
  }
  static v1::LoadStateRequest LoadReq(const std::string& path,
                                      const std::string& client = "trainer0") {
    return StateReq<v1::LoadStateRequest>(path, client);
  }

  v1::StepRequest StepReq(int64_t id) {
    v1::StepRequest s;
    s.set_job_id("job");
    s.set_client_id("trainer0");
    s.set_step_id(id);
    return s;
  }

  void WaitForEngine() {
    for (int i = 0; i < 1000 && !core_->Health().has_plan(); ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_TRUE(core_->Health().has_plan());
  }

  // A build whose peers never come: waits (up to 120 s, far past the test's
  // pace) until the daemon abandons it, as a Gloo/NCCL rendezvous does.
  absl::Status HoldUntilAbandoned(const std::function<bool()>& abandoned) {
    builds_held_.fetch_add(1);
    const absl::Time give_up = absl::Now() + absl::Seconds(120);
    while (!abandoned()) {
      if (absl::Now() > give_up) {
        return absl::DeadlineExceededError("the build was never abandoned");
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    builds_abandoned_.fetch_add(1);
    builds_ended_.fetch_add(1);
    return absl::CancelledError("abandoned");
  }

  // A build stuck where abandonment cannot reach it (Gloo's TCP connect to
  // a peer that gave up) until the test releases it.
  absl::Status StuckUntilReleased() {
    builds_held_.fetch_add(1);
    const absl::Time give_up = absl::Now() + absl::Seconds(120);
    while (!release_stuck_.load() && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    builds_ended_.fetch_add(1);
    return absl::DeadlineExceededError("connect timed out");
  }

  // Abandoned builds run on after the daemon core moved on (its
  // EngineBuilder owns their threads); the fixture outlives them.
  void WaitForBuildsToEnd(int n) {
    for (int i = 0; i < 24000 && builds_ended_.load() < n; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(builds_ended_.load(), n);
  }

  void WaitForHeldBuild() {
    for (int i = 0; i < 2000 && builds_held_.load() == 0; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_EQ(builds_held_.load(), 1);
  }

  // Round 1: registers and receives plan 1 while its build is held (the
  // mode the test set), then unregisters. Round 2: registers again with
  // builds no longer held and waits for plan 2's engine.
  void ReRegisterWhileTheFirstBuildIsHeld() {
    link_.round_version = 1;
    ASSERT_TRUE(core_->Register(Valid()).ok());
    core_->OnPlan(PlanFor(1, 0, 0));
    WaitForHeldBuild();
    v1::UnregisterParamsRequest un;
    un.set_job_id("job");
    un.set_client_id("trainer0");
    ASSERT_TRUE(core_->Unregister(un).ok());
    hold_builds_ = false;
    stuck_builds_ = false;
    link_.round_version = 2;
    ASSERT_TRUE(core_->Register(Valid()).ok());
    core_->OnPlan(PlanFor(2, 0, 1));
    WaitForEngine();
  }

  std::atomic<int> builds_ended_{0};
  std::atomic<bool> fail_builds_{false};
  std::atomic<bool> stuck_builds_{false};
  std::atomic<bool> release_stuck_{false};
  std::atomic<bool> hold_builds_{false};
  std::atomic<int> builds_held_{0};
  std::atomic<int> builds_abandoned_{0};
  // What on_readiness reported, in order.
  std::vector<bool> Readiness() {
    absl::MutexLock lock(&readiness_mu_);
    return readiness_;
  }
  // Waits (bounded, far past the test's pace) for the n-th report.
  std::vector<bool> WaitForReadiness(size_t n) {
    for (int i = 0; i < 4000 && Readiness().size() < n; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    return Readiness();
  }

  absl::Mutex readiness_mu_;
  std::vector<bool> readiness_ ABSL_GUARDED_BY(readiness_mu_);
  std::string name_;
  std::unique_ptr<ShmRegion> region_;
  FakeLink link_;
  FakeMuon* fake_ = nullptr;
  // Before core_, which reports into it.
  DaemonMetrics metrics_;
  std::unique_ptr<DaemonCore> core_;
};

}  // namespace muond::daemon_core_test
