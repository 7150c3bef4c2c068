// DaemonCore in-process with a fake coordinator link and a fake step engine:
// every bad input gets a status naming the param/field and changes nothing.
#include "server/daemon/daemon_core.h"

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
#include "server/common/safetensors.h"

namespace muond {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;

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
  absl::Status ImportState(
      const std::map<std::string, std::vector<float>>& s) override {
    state = s;
    return absl::OkStatus();
  }
  std::map<std::string, std::vector<float>> state = {
      {"w.momentum", std::vector<float>(8, 0.5f)},
      {"v.momentum", std::vector<float>(8, -1.0f)}};
  int64_t state_bytes() const override { return 0; }
  int64_t peak_transient_bytes() const override { return 0; }
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

  // Group "muon" in a 2x2 domain at (0, 0): w (8x4 full, column-parallel
  // GTP+TP: local 2x4) at offset 0, its grad at 256; v (4x8 row-parallel:
  // local 2x4 as a column block of a 2x8 buffer) at 512, grad at 768.
  v1::RegisterParamsRequest Valid() {
    v1::RegisterParamsRequest r;
    r.set_job_id("job");
    r.set_client_id("trainer0");
    *r.add_regions() = HostRegion(*region_);
    v1::ParamGroup* g = r.add_groups();
    g->set_name("muon");
    g->set_algorithm(v1::ALGORITHM_MUON);
    g->mutable_muon()->set_lr(0.02);
    g->mutable_domain()->set_name("dense");
    g->mutable_domain()->set_gtp_size(2);
    g->mutable_domain()->set_tp_size(2);
    char* base = static_cast<char*>(region_->data());
    v1::ShardTags col;
    col.set_tensor_model_parallel(true);
    col.set_partition_dim(0);
    col.set_is_gtp_weight_remat(true);
    *g->add_params() =
        MakeParam("w", {8, 4}, *HostRef(*region_, base, v1::DTYPE_FP32, {2, 4}),
                  *HostRef(*region_, base + 256, v1::DTYPE_FP32, {2, 4}), col);
    v1::ShardTags row = col;
    row.set_partition_dim(1);
    *g->add_params() = MakeParam(
        "v", {4, 8},
        *HostRef(*region_, base + 512, v1::DTYPE_FP32, {2, 4}, {8, 1}),
        *HostRef(*region_, base + 768, v1::DTYPE_FP32, {2, 4}, {8, 1}), row);
    return r;
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
  std::unique_ptr<DaemonCore> core_;
};

TEST_F(DaemonCoreTest, ValidRegistrationPublishesManifest) {
  absl::StatusOr<v1::RegisterParamsResponse> r = core_->Register(Valid());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_params(), 2);
  EXPECT_EQ(r->plan_version(), 0);
  ASSERT_EQ(link_.manifests.size(), 1u);
  const v1::GroupManifest& m = link_.manifests[0].groups(0);
  EXPECT_EQ(m.params(1).name(), "v");
  EXPECT_EQ(m.params(1).local_shape(0), 2);
  EXPECT_EQ(m.params(1).local_shape(1), 4);
  EXPECT_EQ(core_->Status().num_params(), 2);
  // A second registration needs an unregister first.
  EXPECT_EQ(core_->Register(Valid()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// Issue 17: a trainer that died without unregistering leaves its params
// registered. The refusal says so with a reason and the holder, so a new
// trainer can react; only the holder or the operator may clear it.
TEST_F(DaemonCoreTest, AStaleRegistrationIsNamedAndTheOperatorClearsIt) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  const absl::Status again = core_->Register(Valid()).status();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(HasErrorReason(again, ErrorReason::kAlreadyRegistered)) << again;
  EXPECT_EQ(GetErrorMetadata(again).at("client_id"), "trainer0");
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("intruder");
  EXPECT_EQ(core_->Unregister(un).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(core_->Status().num_params(), 2);
  un.set_client_id("muonctl:operator");
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_EQ(core_->Status().num_params(), 0);
  EXPECT_TRUE(core_->Unregister(un).ok());  // nothing registered: OK
  v1::RegisterParamsRequest next = Valid();
  next.set_client_id("trainer1");
  EXPECT_TRUE(core_->Register(next).ok());
}

TEST_F(DaemonCoreTest, BadRegistrationsNameTheProblemAndChangeNothing) {
  v1::RegisterParamsRequest r = Valid();
  r.set_job_id("other");
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "job_id: 'other'");

  r = Valid();
  r.mutable_groups(0)->mutable_params(1)->set_name("w");
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "param 'w': duplicate param name");

  r = Valid();
  r.mutable_groups(0)->mutable_params(0)->mutable_grad()->set_dtype(
      v1::DTYPE_UNSPECIFIED);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "param 'w' grad: dtype");

  // A stride that makes the view run past the 4096-byte region.
  r = Valid();
  r.mutable_groups(0)->mutable_params(1)->mutable_param()->set_strides(0, 1000);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "param 'v' param: view [512, 4528) bytes runs past region '" +
                    name_ + "' of 4096 bytes");

  // An offset near the end.
  r = Valid();
  r.mutable_groups(0)->mutable_params(0)->mutable_grad()->set_byte_offset(4090);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "param 'w' grad: view [4090, 4122) bytes runs past region");

  // Overflowing extents.
  r = Valid();
  r.mutable_groups(0)->mutable_params(0)->mutable_param()->set_strides(
      0, int64_t(1) << 62);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "overflows int64");

  // Innermost stride.
  r = Valid();
  r.mutable_groups(0)->mutable_params(0)->mutable_param()->set_strides(1, 2);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "param 'w' param: innermost stride is 2");

  // Shape that does not follow from full shape and tags.
  r = Valid();
  r.mutable_groups(0)->mutable_params(0)->set_full_shape(0, 16);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "param 'w'");

  // Grad shape differs from the local shard.
  r = Valid();
  r.mutable_groups(0)->mutable_params(0)->mutable_grad()->set_shape(0, 3);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "param 'w' grad: shape [3, 4] should be [2, 4]");

  // Missing shm object.
  r = Valid();
  r.mutable_regions(0)->set_shm_name("/muond-no-such-object");
  ExpectRefused(r, absl::StatusCode::kNotFound, "'/muond-no-such-object'");

  // CUDA IPC on a host-mode daemon.
  r = Valid();
  r.mutable_regions(0)->set_kind(v1::MEMORY_KIND_CUDA_IPC);
  ExpectRefused(r, absl::StatusCode::kFailedPrecondition, "--host mode");

  // A ref to a region the request does not declare.
  r = Valid();
  r.mutable_groups(0)->mutable_params(1)->mutable_grad()->set_region("other");
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "param 'v' grad: region 'other' is not declared");

  // A region declared twice.
  r = Valid();
  *r.add_regions() = r.regions(0);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "region '" + name_ + "': declared twice");

  // Domain coordinates outside the domain.
  r = Valid();
  r.mutable_groups(0)->mutable_domain()->set_t(2);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "group 'muon' domain: (g=0, t=2) lies outside 2x2");

  EXPECT_TRUE(link_.manifests.empty());
  // After all that a valid registration still works.
  EXPECT_TRUE(core_->Register(Valid()).ok());
}

TEST_F(DaemonCoreTest, ShmObjectTooSmall) {
  const std::string small = name_ + "-small";
  auto tiny = ShmRegion::Create(small, 16);
  ASSERT_TRUE(tiny.ok());
  v1::RegisterParamsRequest r = Valid();
  *r.add_regions() = HostRegion(**tiny);
  r.mutable_groups(0)->mutable_params(0)->mutable_grad()->set_region(small);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "param 'w' grad: view [256, 288) bytes runs past region '" +
                    small + "' of 16 bytes");
  // A region larger than its shm object.
  r = Valid();
  *r.add_regions() = HostRegion(**tiny);
  r.mutable_regions(1)->set_byte_size(32);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument,
                "region '" + small + "': shm object '" + small +
                    "' has 16 bytes, fewer than the region's byte_size 32");
}

TEST_F(DaemonCoreTest, TrainerDisconnectingMidRegistrationRegistersNothing) {
  absl::StatusOr<v1::RegisterParamsResponse> r =
      core_->Register(Valid(), [] { return true; });
  EXPECT_EQ(r.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(core_->Status().num_params(), 0);
  EXPECT_TRUE(core_->Register(Valid()).ok());
}

// A refusal of the daemon's own checks for its job reaches the coordinator
// (which refuses the round on every rank); a wrong job id, a registration
// over another one or a trainer that hung up does not.
TEST_F(DaemonCoreTest, OwnRefusalIsPublishedToTheCoordinator) {
  v1::RegisterParamsRequest bad = Valid();
  bad.mutable_groups(0)->mutable_params(0)->mutable_param()->add_shape(3);
  const absl::Status refused = core_->Register(bad).status();
  ASSERT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(link_.refusals.size(), 1u);
  EXPECT_EQ(link_.refusals[0], refused.message());
  EXPECT_TRUE(link_.manifests.empty());
  EXPECT_EQ(core_->Status().num_params(), 0);

  v1::RegisterParamsRequest other_job = Valid();
  other_job.set_job_id("another-job");
  EXPECT_FALSE(core_->Register(other_job).ok());
  EXPECT_EQ(core_->Register(Valid(), [] { return true; }).status().code(),
            absl::StatusCode::kCancelled);
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Register(Valid()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(link_.refusals.size(), 1u);
}

TEST_F(DaemonCoreTest, CoordinatorRefusingManifestRegistersNothing) {
  link_.publish_status = absl::InvalidArgumentError("manifest mismatch at 'w'");
  absl::StatusOr<v1::RegisterParamsResponse> r = core_->Register(Valid());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("'w'"));
  EXPECT_EQ(core_->Status().num_params(), 0);
}

TEST_F(DaemonCoreTest, StepRulesAndPlanActivation) {
  EXPECT_THAT(core_->Step(StepReq(1)).status().message(),
              HasSubstr("no params are registered"));
  ASSERT_TRUE(core_->Register(Valid()).ok());
  absl::Status before = core_->Step(StepReq(1)).status();
  EXPECT_EQ(before.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(before.message(), HasSubstr("before the plan"));

  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  float* w = static_cast<float*>(region_->data());
  ASSERT_EQ(*w, 0.0f);
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 1);
  EXPECT_FALSE(s1->replayed());
  EXPECT_EQ(*w, 1.0f);
  ASSERT_EQ(link_.reports.size(), 1u);
  EXPECT_EQ(link_.reports[0].step_id(), 1);

  // Replay: recorded answer, nothing applied.
  absl::StatusOr<v1::StepResponse> again = core_->Step(StepReq(1));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->replayed());
  EXPECT_EQ(again->timings().total_us(), 7);
  EXPECT_EQ(*w, 1.0f);

  // Backwards and gaps name both ids.
  absl::Status back = core_->Step(StepReq(0)).status();
  EXPECT_EQ(back.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(back.message(), HasSubstr("step_id 0"));
  EXPECT_THAT(back.message(), HasSubstr("last applied step_id 1"));
  EXPECT_THAT(core_->Step(StepReq(5)).status().message(),
              HasSubstr("step_id 5"));
  EXPECT_EQ(*w, 1.0f);

  // Wrong job, foreign client, unknown group in overrides.
  v1::StepRequest bad = StepReq(2);
  bad.set_job_id("nope");
  EXPECT_EQ(core_->Step(bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = StepReq(2);
  bad.set_client_id("intruder");
  EXPECT_EQ(core_->Step(bad).status().code(),
            absl::StatusCode::kPermissionDenied);
  bad = StepReq(2);
  bad.add_overrides()->set_group("ghost");
  EXPECT_THAT(core_->Step(bad).status().message(),
              HasSubstr("unknown group 'ghost'"));
  EXPECT_EQ(*w, 1.0f);

  // A plan activating at step 3: step 2 keeps version 1, step 3 switches.
  core_->OnPlan(PlanFor(2, 3, 1));
  EXPECT_EQ(core_->Status().latest_plan_version(), 2);
  EXPECT_EQ(core_->Step(StepReq(2))->plan_version(), 1);
  EXPECT_EQ(core_->Step(StepReq(3))->plan_version(), 2);
  ASSERT_EQ(fake_->homes_set.size(), 2u);
  EXPECT_EQ(fake_->homes_set[1].second[0].g, 1);
  EXPECT_EQ(*w, 3.0f);
  EXPECT_EQ(core_->Status().last_step_id(), 3);

  // Unregister drops the engine; a new registration starts fresh step ids.
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_FALSE(core_->Health().has_plan());
  EXPECT_EQ(core_->Status().num_params(), 0);
}

// Two plans that become active at the same step both reach the engine, in
// version order, so this rank can route by the older one while a peer that
// has not received the newer one yet catches up; the response names the
// version the domain agreed on.
// skip_params and the overrides reach the engine as they were sent; a skip
// name the daemon does not hold, a field of the other algorithm or a value
// out of bounds is refused through the engine's job vote (the refusal is
// the step's inputs.refusal), naming it, and nothing is applied.
TEST_F(DaemonCoreTest, SkipParamsAndOverridesReachTheEngineOrAreRefused) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  float* w = static_cast<float*>(region_->data());
  v1::StepRequest bad = StepReq(1);
  bad.add_skip_params("w");
  bad.add_skip_params("ghost");
  absl::Status st = core_->Step(bad).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(), HasSubstr("skip_params: 'ghost' names no param"));
  EXPECT_EQ(*w, 0.0f);
  bad = StepReq(1);
  v1::GroupOverride* o = bad.add_overrides();
  o->set_group("muon");
  o->set_beta1(0.9);
  st = core_->Step(bad).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(),
              HasSubstr("group 'muon' beta1 is an AdamW hyperparameter"));
  o->clear_beta1();
  o->set_momentum(1.0);
  EXPECT_THAT(core_->Step(bad).status().message(),
              HasSubstr("group 'muon' momentum must be in [0, 1)"));
  EXPECT_EQ(*w, 0.0f);
  // One GroupOverride per group: a second (even a valid one) is refused.
  o->set_momentum(0.5);
  bad.add_overrides()->set_group("muon");
  st = core_->Step(bad).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(),
              HasSubstr("group 'muon' has more than one GroupOverride"));
  EXPECT_EQ(*w, 0.0f);

  v1::StepRequest good = StepReq(1);
  good.add_skip_params("v");
  o = good.add_overrides();
  o->set_group("muon");
  o->set_momentum(0.5);
  o->set_nesterov(false);
  absl::StatusOr<v1::StepResponse> r = core_->Step(good);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(fake_->skip_params, std::set<std::string>{"v"});
  EXPECT_EQ(fake_->overrides.momentum.at("muon"), 0.5);
  EXPECT_EQ(fake_->overrides.nesterov.at("muon"), false);
  EXPECT_TRUE(fake_->overrides.lr.empty());
}

TEST_F(DaemonCoreTest, EveryPlanVersionReachesTheEngineInOrder) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  core_->OnPlan(PlanFor(2, 3, 1));
  core_->OnPlan(PlanFor(3, 3, 0));
  core_->OnPlan(PlanFor(4, 9, 1));  // later: not handed over at step 3
  ASSERT_TRUE(core_->Step(StepReq(2)).ok());
  fake_->agreed_version = 2;  // a peer holds version 2 only
  absl::StatusOr<v1::StepResponse> s3 = core_->Step(StepReq(3));
  ASSERT_TRUE(s3.ok()) << s3.status();
  EXPECT_EQ(s3->plan_version(), 2);
  EXPECT_EQ(fake_->versions_set, (std::vector<int64_t>{1, 2, 3}));
  ASSERT_EQ(fake_->homes_set.size(), 3u);
  EXPECT_EQ(fake_->homes_set[1].second[0].g, 1);
  EXPECT_EQ(fake_->homes_set[2].second[0].g, 0);
}

// A daemon keeps its newest 64 plans; the engine gets the kept versions.
TEST_F(DaemonCoreTest, KeepsTheNewestPlans) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  for (int64_t v = 1; v <= 70; ++v) core_->OnPlan(PlanFor(v, 0, v % 2));
  WaitForEngine();
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 70);
  ASSERT_EQ(fake_->versions_set.size(), 64u);
  EXPECT_EQ(fake_->versions_set.front(), 7);
  EXPECT_EQ(fake_->versions_set.back(), 70);
}

// A re-registration uses only plans of its own round (never the plan of the
// previous trainer, whose rendezvous keys are stale); when every plan of the
// round activates later than the step, the round's oldest one serves it.
TEST_F(DaemonCoreTest, ReRegistrationUsesOnlyItsRoundsPlans) {
  link_.round_version = 1;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_EQ(core_->Step(StepReq(1))->plan_version(), 1);
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());

  link_.round_version = 2;
  absl::StatusOr<v1::RegisterParamsResponse> again = core_->Register(Valid());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->plan_version(), 0) << "plan 1 belongs to the last round";
  absl::Status early = core_->Step(StepReq(1)).status();
  EXPECT_THAT(early.message(), HasSubstr("before the plan"));
  core_->OnPlan(PlanFor(2, 10, 1));  // the round's plan activates later
  WaitForEngine();
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 2);
  ASSERT_FALSE(fake_->homes_set.empty());
  EXPECT_EQ(fake_->homes_set.back().second[0].g, 1);
}

// A trainer that unregisters while the daemon waits for its domain's peers
// (client_recovery_test's failed constructor: one rank got the plan only after
// the unregister and never joined) must not leave the next registration
// waiting out the communicator timeout.
TEST_F(DaemonCoreTest, UnregisterAbandonsAnEngineStillWaitingForPeers) {
  hold_builds_ = true;
  ReRegisterWhileTheFirstBuildIsHeld();
  ASSERT_FALSE(HasFatalFailure());
  WaitForBuildsToEnd(1);
  EXPECT_EQ(builds_abandoned_.load(), 1);
  EXPECT_EQ(core_->engine_error(), "") << "an abandoned build is no error";
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 2);
}

// The same when the build cannot be interrupted (stuck connecting to a peer
// that gave up): the daemon leaves it to end in the background and builds
// the next registration's engine meanwhile.
TEST_F(DaemonCoreTest, UnregisterLeavesAStuckBuildBehind) {
  stuck_builds_ = true;
  ReRegisterWhileTheFirstBuildIsHeld();  // while the first build is stuck
  ASSERT_FALSE(HasFatalFailure());
  absl::StatusOr<v1::StepResponse> s1 = core_->Step(StepReq(1));
  ASSERT_TRUE(s1.ok()) << s1.status();
  EXPECT_EQ(s1->plan_version(), 2);
  EXPECT_EQ(core_->engine_error(), "");
  EXPECT_EQ(builds_ended_.load(), 0) << "the first build is still stuck";
  release_stuck_ = true;
  WaitForBuildsToEnd(1);
}

// A failed engine build is reported by Health (the daemon waits for a new
// plan), so a trainer waiting for has_plan can stop with the reason; a new
// registration clears it.
TEST_F(DaemonCoreTest, HealthReportsAFailedEngineBuild) {
  fail_builds_ = true;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Health().engine_error(), "");
  core_->OnPlan(PlanFor(1, 0, 0));
  for (int i = 0; i < 2000 && core_->Health().engine_error().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const v1::HealthResponse h = core_->Health();
  EXPECT_FALSE(h.has_plan());
  EXPECT_THAT(h.engine_error(), HasSubstr("rendezvous: rank 1 never came"));
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_EQ(core_->Health().engine_error(), "") << "nothing is registered";
  fail_builds_ = false;
  link_.round_version = 2;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Health().engine_error(), "");
  core_->OnPlan(PlanFor(2, 0, 0));
  WaitForEngine();
  EXPECT_EQ(core_->Health().engine_error(), "");
}

// The readiness callback (the grpc.health.v1 status) follows has_plan:
// nothing while an engine build fails, true once an engine stands, false when
// the trainer unregisters and when the core goes away.
TEST_F(DaemonCoreTest, ReadinessFollowsTheEngine) {
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  fail_builds_ = true;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  for (int i = 0; i < 2000 && core_->Health().engine_error().empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_FALSE(core_->Health().engine_error().empty());
  ASSERT_TRUE(core_->Unregister(un).ok());
  fail_builds_ = false;
  link_.round_version = 2;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(2, 0, 0));
  WaitForEngine();
  EXPECT_EQ(WaitForReadiness(1), std::vector<bool>({true}))
      << "the failed build reported nothing";
  ASSERT_TRUE(core_->Unregister(un).ok());
  EXPECT_EQ(WaitForReadiness(2), std::vector<bool>({true, false}));
  link_.round_version = 3;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(3, 0, 0));
  EXPECT_EQ(WaitForReadiness(3), std::vector<bool>({true, false, true}));
  core_.reset();
  EXPECT_EQ(Readiness(), std::vector<bool>({true, false, true, false}));
}

v1::Plan RoundRefusal(const std::string& reason) {
  v1::Plan refusal;
  refusal.set_job_id("job");
  refusal.set_round_refused(reason);
  return refusal;
}

// The coordinator refused the round of this daemon's registration (another
// rank's manifest disagreed): Health says so at once, with the reason, until
// a new registration; the refusal is no plan.
TEST_F(DaemonCoreTest, HealthReportsARefusedRound) {
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(RoundRefusal("rank 1: full_shape [64, 32] vs [128, 32]"));
  v1::HealthResponse h = core_->Health();
  EXPECT_FALSE(h.has_plan());
  EXPECT_EQ(h.engine_error(),
            "the coordinator refused the registration round (register again "
            "on every rank): rank 1: full_shape [64, 32] vs [128, 32]");
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  link_.round_version = 1;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_EQ(core_->Health().engine_error(), "") << "a new registration";
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  h = core_->Health();
  EXPECT_TRUE(h.has_plan());
  EXPECT_EQ(h.engine_error(), "");
  // A refusal reaching a daemon that steps with its engine changes nothing.
  core_->OnPlan(RoundRefusal("a later round"));
  EXPECT_TRUE(core_->Health().has_plan());
  EXPECT_EQ(core_->Health().engine_error(), "");
}

// The refusal of a registration's round may overtake the answer to its
// publish: the registration is still reported refused.
TEST_F(DaemonCoreTest, ARefusalDuringThePublishIsKept) {
  link_.during_publish = [this] { core_->OnPlan(RoundRefusal("mismatch")); };
  ASSERT_TRUE(core_->Register(Valid()).ok());
  EXPECT_THAT(core_->Health().engine_error(), HasSubstr("mismatch"));
}

// Shutting down does not wait out a rendezvous either.
TEST_F(DaemonCoreTest, ShutdownAbandonsAnEngineStillWaitingForPeers) {
  hold_builds_ = true;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForHeldBuild();
  core_.reset();
  WaitForBuildsToEnd(1);
  EXPECT_EQ(builds_abandoned_.load(), 1);
}

TEST_F(DaemonCoreTest, SaveAndLoadStateRoundTrip) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  EXPECT_EQ(core_->SaveState(StateReq(path)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  fake_->state["w.momentum"][3] = 7.25f;
  absl::StatusOr<v1::SaveStateResponse> saved =
      core_->SaveState(StateReq(path));
  ASSERT_TRUE(saved.ok()) << saved.status();
  // The file is plain safetensors with per-shard keys.
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE(file->tensors.count("w/g0t0/momentum"));
  EXPECT_EQ(file->tensors["w/g0t0/momentum"].shape,
            (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(file->tensors["w/g0t0/momentum"].data[3], 7.25f);
  EXPECT_EQ(file->metadata["step_id"], "4");

  fake_->state["w.momentum"].assign(8, 0.0f);
  ASSERT_TRUE(core_->Step(StepReq(5)).ok());
  absl::StatusOr<v1::LoadStateResponse> loaded =
      core_->LoadState(LoadReq(path));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step_id(), 4);
  EXPECT_EQ(fake_->state["w.momentum"][3], 7.25f);
  EXPECT_TRUE(core_->Step(StepReq(5)).ok());  // resumes after the saved step

  // A file lacking a tensor is refused, naming it; nothing changes.
  file->tensors.erase("v/g0t0/momentum");
  ASSERT_TRUE(WriteSafetensors(path, *file).ok());
  absl::Status bad = core_->LoadState(LoadReq(path)).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("'v/g0t0/momentum'"));
  EXPECT_EQ(core_->Status().last_step_id(), 5);
  unlink(path.c_str());
}

// Issue 16: only the owner or the operator (muonctl) may save or load.
TEST_F(DaemonCoreTest, SaveAndLoadAreTheOwnersOrTheOperators) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  ASSERT_TRUE(core_->SaveState(StateReq(path)).ok());
  for (const std::string client : {"intruder", ""}) {
    absl::Status save = core_->SaveState(StateReq(path, client)).status();
    EXPECT_EQ(save.code(), absl::StatusCode::kPermissionDenied) << save;
    absl::Status load = core_->LoadState(LoadReq(path, client)).status();
    EXPECT_EQ(load.code(), absl::StatusCode::kPermissionDenied) << load;
    EXPECT_THAT(load.message(), HasSubstr("'" + client + "'"));
  }
  v1::LoadStateRequest other_job = LoadReq(path);
  other_job.set_job_id("other");
  EXPECT_EQ(core_->LoadState(other_job).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(core_->SaveState(StateReq(path, "muonctl:operator")).ok());
  EXPECT_TRUE(core_->LoadState(LoadReq(path, "muonctl:operator")).ok());
  unlink(path.c_str());
}

// Issue 16: the file is written without the daemon's locks, so Health,
// Status and Step answer while a save is in its I/O (the cancellation check
// between tensors stands for a slow disk here).
TEST_F(DaemonCoreTest, HealthAndStepAnswerDuringASave) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  absl::Notification writing, release;
  std::thread save([&] {
    auto saved = core_->SaveState(StateReq(path), [&] {
      if (!writing.HasBeenNotified()) writing.Notify();
      release.WaitForNotification();
      return false;
    });
    EXPECT_TRUE(saved.ok()) << saved.status();
    EXPECT_EQ(saved->step_id(), 1);  // the state as of the copy
  });
  writing.WaitForNotification();
  EXPECT_TRUE(core_->Health().serving());
  EXPECT_EQ(core_->Status().last_step_id(), 1);
  EXPECT_TRUE(core_->Step(StepReq(2)).ok());
  release.Notify();
  save.join();
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata["step_id"], "1");
  unlink(path.c_str());
}

// Issue 16: a cancelled save (the daemon shutting down) stops and leaves no
// file.
TEST_F(DaemonCoreTest, CancelledSaveLeavesNoFile) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  absl::Status st =
      core_->SaveState(StateReq(path), [] { return true; }).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

// Issue 16: the two phases. PREPARE changes nothing visible; COMMIT applies
// (save: the file appears); ABORT, a newer PREPARE or a step in between
// drop a prepared load.
TEST_F(DaemonCoreTest, TwoPhaseSaveAndLoad) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  fake_->state["w.momentum"][0] = 3.5f;
  auto phased = [&](auto req, v1::StatePhase phase, const std::string& id) {
    req.set_phase(phase);
    req.set_transaction_id(id);
    return req;
  };
  v1::SaveStateRequest save = StateReq(path);
  // A phase needs a transaction id.
  EXPECT_EQ(core_->SaveState(phased(save, v1::STATE_PHASE_PREPARE, ""))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  auto prepared = core_->SaveState(phased(save, v1::STATE_PHASE_PREPARE, "t1"));
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(prepared->step_id(), 4);
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "PREPARE put the file in place";
  EXPECT_EQ(core_->SaveState(phased(save, v1::STATE_PHASE_COMMIT, "t0"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(
      core_->SaveState(phased(save, v1::STATE_PHASE_COMMIT, "t1")).ok());
  EXPECT_EQ(access(path.c_str(), F_OK), 0);

  fake_->state["w.momentum"][0] = 0.0f;
  ASSERT_TRUE(core_->Step(StepReq(5)).ok());
  v1::LoadStateRequest load = LoadReq(path);
  auto staged = core_->LoadState(phased(load, v1::STATE_PHASE_PREPARE, "l1"));
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->step_id(), 4);
  EXPECT_EQ(staged->job_id(), "job");
  EXPECT_EQ(core_->Status().last_step_id(), 5);  // nothing applied yet
  EXPECT_EQ(fake_->state["w.momentum"][0], 0.0f);
  ASSERT_TRUE(core_->LoadState(phased(load, v1::STATE_PHASE_ABORT, "l1")).ok());
  EXPECT_EQ(core_->LoadState(phased(load, v1::STATE_PHASE_COMMIT, "l1"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  // A step between PREPARE and COMMIT: the staged state is stale.
  ASSERT_TRUE(
      core_->LoadState(phased(load, v1::STATE_PHASE_PREPARE, "l2")).ok());
  ASSERT_TRUE(core_->Step(StepReq(6)).ok());
  EXPECT_EQ(core_->LoadState(phased(load, v1::STATE_PHASE_COMMIT, "l2"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_->Status().last_step_id(), 6);
  ASSERT_TRUE(
      core_->LoadState(phased(load, v1::STATE_PHASE_PREPARE, "l3")).ok());
  auto committed = core_->LoadState(phased(load, v1::STATE_PHASE_COMMIT, "l3"));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(core_->Status().last_step_id(), 4);
  EXPECT_EQ(fake_->state["w.momentum"][0], 3.5f);
  unlink(path.c_str());
}

template <typename Request>
Request Phased(Request req, v1::StatePhase phase, const std::string& id) {
  req.set_phase(phase);
  req.set_transaction_id(id);
  return req;
}

// Issue 16 (hostile review): one pending transaction per rank. A second
// PREPARE (save or load) is refused naming the pending one; COMMIT/ABORT of
// another id leave it alone; so the first transaction still commits.
TEST_F(DaemonCoreTest, PendingTransactionBlocksAnotherPrepare) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  const std::string other = path + ".b";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  ASSERT_TRUE(core_->SaveState(StateReq(path)).ok());
  ASSERT_TRUE(core_->Step(StepReq(5)).ok());

  const v1::LoadStateRequest load = LoadReq(path);
  ASSERT_TRUE(
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "A")).ok());
  auto refused = core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "B"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("'A'"));
  // The age has a unit even under a millisecond ("0s", not "0").
  EXPECT_THAT(std::string(refused.status().message()),
              ContainsRegex("prepared [0-9.]+[a-z]+ ago"));
  // A save is refused too, and writes nothing.
  auto save_b =
      core_->SaveState(Phased(StateReq(other), v1::STATE_PHASE_PREPARE, "B"));
  EXPECT_EQ(save_b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(access(other.c_str(), F_OK), 0);
  // B's ABORT and a stray COMMIT do not touch A.
  EXPECT_TRUE(core_->LoadState(Phased(load, v1::STATE_PHASE_ABORT, "B")).ok());
  EXPECT_TRUE(
      core_->SaveState(Phased(StateReq(path), v1::STATE_PHASE_ABORT, "B"))
          .ok());
  EXPECT_EQ(core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "B"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  auto committed = core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "A"));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(core_->Status().last_step_id(), 4);

  // A pending save blocks a load PREPARE the same way; once committed, the
  // rank is free again.
  const v1::SaveStateRequest save = StateReq(other);
  ASSERT_TRUE(
      core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "C")).ok());
  EXPECT_EQ(core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "D"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(core_->LoadState(Phased(load, v1::STATE_PHASE_ABORT, "D")).ok());
  ASSERT_TRUE(core_->SaveState(Phased(save, v1::STATE_PHASE_COMMIT, "C")).ok());
  EXPECT_EQ(access(other.c_str(), F_OK), 0);
  ASSERT_TRUE(
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "D")).ok());
  ASSERT_TRUE(core_->LoadState(Phased(load, v1::STATE_PHASE_ABORT, "D")).ok());
  unlink(path.c_str());
  unlink(other.c_str());
}

// A load staged for a registration that is gone could never commit: Unregister
// drops it, so the next registration's PREPARE is not blocked (a trainer that
// re-registers to add a param group, then imports under a transaction).
TEST_F(DaemonCoreTest, UnregisterDropsThePendingTransaction) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  ASSERT_TRUE(core_->SaveState(StateReq(path)).ok());
  const v1::LoadStateRequest load = LoadReq(path);
  ASSERT_TRUE(
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "A")).ok());
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  link_.round_version = 2;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(2, 0, 0));
  WaitForEngine();
  absl::StatusOr<v1::LoadStateResponse> b =
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "B"));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "A"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<v1::LoadStateResponse> committed =
      core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "B"));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(core_->Status().last_step_id(), 4);
  unlink(path.c_str());
}

// A transaction whose muonctl died between the phases stops blocking the
// rank after pending_transaction_max_age (200 ms here): the next PREPARE
// drops it (its temporary file too).
TEST_F(DaemonCoreTest, StalePendingTransactionIsDropped) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  const v1::SaveStateRequest save = StateReq(path);
  ASSERT_TRUE(
      core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "A")).ok());
  EXPECT_EQ(core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "B"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(
      core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "B")).ok());
  EXPECT_EQ(core_->SaveState(Phased(save, v1::STATE_PHASE_COMMIT, "A"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(core_->SaveState(Phased(save, v1::STATE_PHASE_COMMIT, "B")).ok());
  EXPECT_EQ(access(path.c_str(), F_OK), 0);
  unlink(path.c_str());
}

}  // namespace
}  // namespace muond
