// OptimizerTable in process: several optimizer instances on one daemon, each
// a DaemonCore with a fake coordinator link and a fake engine (adds 1 to the
// first element of each param per step) over its own shm region; the
// service's routing by name; the daemon-wide readiness that the Health RPC
// and grpc.health.v1 both say.
#include "server/daemon/optimizer_table.h"

#include <sys/mman.h>

#include <map>
#include <memory>
#include <string>

#include "server/common/job_id.h"
#include "tests/server/daemon/daemon_core_fixture.h"

namespace muond::daemon_core_test {
namespace {

// One instance's memory: params w (offset 0) and v (512), fp32.
struct InstanceMemory {
  std::unique_ptr<ShmRegion> region;
  float w0() const { return static_cast<float*>(region->data())[0]; }
  float v0() const { return static_cast<float*>(region->data())[128]; }
};

class OptimizerTableTest : public ::testing::Test {
 protected:
  void TearDown() override {
    table_.reset();  // the cores go before the links and regions they use
  }

  // A table whose factory makes instances over fake links; `on_serving`
  // records the grpc.health.v1 value.
  void MakeTable(int max_instances = kMaxOptimizerInstances) {
    table_ = std::make_unique<OptimizerTable>(
        [this](const std::string& name, std::function<void(bool)> ready) {
          return MakeInstance(name, std::move(ready));
        },
        [this](bool serving) { grpc_serving_.store(serving); }, max_instances);
    ASSERT_TRUE(table_->ok().ok()) << table_->ok();
  }

  absl::StatusOr<std::unique_ptr<OptimizerInstance>> MakeInstance(
      const std::string& name, std::function<void(bool)> on_readiness) {
    auto link = std::make_shared<FakeLink>();
    DaemonConfig config;
    config.job_id = "job";
    config.world_size = 4;
    config.optimizer = name;
    config.on_readiness = std::move(on_readiness);
    auto instance = std::make_unique<OptimizerInstance>();
    instance->core = std::make_shared<DaemonCore>(
        config, std::make_unique<HandleOpener>(), link.get(),
        [](const Registration& reg, const v1::Plan&,
           const std::function<bool()>&)
            -> absl::StatusOr<std::unique_ptr<StepEngine>> {
          std::vector<float*> firsts;
          for (const BoundGroup& g : reg.groups) {
            for (const BoundParam& p : g.params) {
              firsts.push_back(static_cast<float*>(p.param.data));
            }
          }
          auto engine = std::make_unique<StepEngine>();
          engine->muon = std::make_unique<FakeMuon>(firsts);
          return engine;
        });
    instance->job = InstanceJobId("job", name);
    instance->start = [this, name](absl::Duration timeout) {
      if (join_) return join_(name, timeout);
      started_.push_back(name);
      return absl::OkStatus();
    };
    instance->owned = link;
    return instance;
  }

  // The fixture's 2x2-domain registration over a fresh region of its own.
  v1::RegisterParamsRequest RegisterRequest(const std::string& name,
                                            const std::string& client) {
    InstanceMemory& memory = memory_[name];
    const std::string shm = absl::StrCat(
        "/muond-table-test-", getpid(), "-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name(), "-",
        regions_made_++);
    shm_unlink(shm.c_str());  // left by a crashed run
    memory.region = *ShmRegion::Create(shm, 4096);
    v1::RegisterParamsRequest r = TwoByTwoRequest(*memory.region, client);
    r.set_optimizer(name);
    return r;
  }

  // Registers instance `name` for `client` and hands it a plan; waits
  // (bounded) until it can step.
  void RegisterWithPlan(const std::string& name, const std::string& client) {
    ASSERT_TRUE(table_->Register(RegisterRequest(name, client), {}).ok());
    absl::StatusOr<std::shared_ptr<OptimizerInstance>> found =
        table_->Find(name);
    ASSERT_TRUE(found.ok()) << found.status();
    v1::Plan plan;
    plan.set_job_id(InstanceJobId("job", name));
    plan.set_version(1);
    v1::GroupPlan* g = plan.add_groups();
    g->set_group("muon");
    for (int t = 0; t < 2; ++t) g->add_homes()->set_t(t);
    (*found)->core->OnPlan(plan);
    v1::HealthRequest asked;
    asked.set_optimizer(name);
    for (int i = 0; i < 2000 && !table_->Health(asked)->has_plan(); ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    ASSERT_TRUE(table_->Health(asked)->has_plan());
  }

  absl::StatusOr<v1::StepResponse> Step(const std::string& name,
                                        const std::string& client, int64_t id) {
    v1::StepRequest s;
    s.set_job_id("job");
    s.set_client_id(client);
    s.set_step_id(id);
    s.set_optimizer(name);
    absl::StatusOr<std::shared_ptr<OptimizerInstance>> found =
        table_->Find(name);
    if (!found.ok()) return found.status();
    return (*found)->core->Step(s);
  }

  absl::Status Unregister(const std::string& name, const std::string& client) {
    v1::UnregisterParamsRequest u;
    u.set_job_id("job");
    u.set_client_id(client);
    u.set_optimizer(name);
    return table_->Unregister(u);
  }

  // Waits (bounded) until grpc.health.v1's value is `serving`, then checks
  // the Health RPC says the same.
  void ExpectDaemonServing(bool serving) {
    for (int i = 0; i < 2000 && grpc_serving_.load() != serving; ++i) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(grpc_serving_.load(), serving);
    absl::StatusOr<v1::HealthResponse> health = table_->Health({});
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(health->has_plan(), grpc_serving_.load());
  }

  int regions_made_ = 0;
  std::atomic<bool> grpc_serving_{false};
  std::vector<std::string> started_;
  // When set, an instance's coordinator join (name, the time it may take).
  std::function<absl::Status(const std::string&, absl::Duration)> join_;
  std::map<std::string, InstanceMemory> memory_;
  std::unique_ptr<OptimizerTable> table_;
};

TEST_F(OptimizerTableTest, TwoInstancesRegisterStepAndUnregisterIndependently) {
  MakeTable();
  RegisterWithPlan("", "trainer-a");
  RegisterWithPlan("gan-d", "trainer-b");
  // The named instance joined its job when it was made; the default one is
  // joined by the daemon at start.
  EXPECT_EQ(started_, std::vector<std::string>{"gan-d"});
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre("", "gan-d"));

  ASSERT_TRUE(Step("", "trainer-a", 0).ok());
  EXPECT_EQ(memory_[""].w0(), 1.0f);
  EXPECT_EQ(memory_["gan-d"].w0(), 0.0f);
  // Each instance has its own step ids and owner.
  ASSERT_TRUE(Step("gan-d", "trainer-b", 7).ok());
  EXPECT_EQ(memory_["gan-d"].w0(), 1.0f);
  EXPECT_EQ(memory_["gan-d"].v0(), 1.0f);
  EXPECT_EQ(memory_[""].w0(), 1.0f);
  absl::StatusOr<v1::StepResponse> foreign = Step("gan-d", "trainer-a", 8);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(foreign.status().message(),
              HasSubstr("does not own the params of optimizer 'gan-d'"));

  // Unregistering one leaves the other stepping; the named one is removed.
  ASSERT_TRUE(Unregister("", "trainer-a").ok());
  ASSERT_TRUE(Step("gan-d", "trainer-b", 8).ok());
  EXPECT_EQ(memory_["gan-d"].w0(), 2.0f);
  ASSERT_TRUE(Unregister("gan-d", "trainer-b").ok());
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre(""));
  absl::StatusOr<v1::StepResponse> gone = Step("gan-d", "trainer-b", 9);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(gone.status().message(), HasSubstr("optimizer 'gan-d'"));
  EXPECT_EQ(memory_["gan-d"].w0(), 2.0f);
  // The default instance stays, without a registration.
  absl::StatusOr<v1::GetStatusResponse> status = table_->Status("");
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->num_params(), 0);
}

TEST_F(OptimizerTableTest, StatusNamesTheInstanceAndListsEveryInstance) {
  MakeTable();
  RegisterWithPlan("gan-d", "trainer-b");
  absl::StatusOr<v1::GetStatusResponse> status = table_->Status("");
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->num_params(), 0);  // the default instance's own
  EXPECT_THAT(status->optimizers(), ::testing::ElementsAre("", "gan-d"));
  status = table_->Status("gan-d");
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->optimizer(), "gan-d");
  EXPECT_EQ(status->num_params(), 2);
}

TEST_F(OptimizerTableTest, BadNameIsRefusedNamingTheFieldAndTheRule) {
  MakeTable();
  for (const std::string& bad :
       {std::string("a/b"), std::string("sp ace"), std::string(65, 'x')}) {
    absl::StatusOr<v1::RegisterParamsResponse> got =
        table_->Register(RegisterRequest(bad, "trainer-a"), {});
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(got.status().message(), HasSubstr("optimizer="));
    EXPECT_THAT(got.status().message(),
                HasSubstr("must be 1-64 characters of [A-Za-z0-9._-]"));
    EXPECT_EQ(Step(bad, "trainer-a", 0).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre(""));
  EXPECT_TRUE(started_.empty());
}

TEST_F(OptimizerTableTest, CapIsRefusedNamingItTheInstancesAndTheirOwners) {
  MakeTable(/*max_instances=*/2);
  RegisterWithPlan("", "trainer-a");
  RegisterWithPlan("opt-2", "trainer-b");
  absl::StatusOr<v1::RegisterParamsResponse> got =
      table_->Register(RegisterRequest("opt-3", "trainer-c"), {});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(got.status().message(), HasSubstr("optimizer 'opt-3'"));
  EXPECT_THAT(got.status().message(), HasSubstr("the most it may (2)"));
  EXPECT_THAT(got.status().message(),
              HasSubstr("'' (client 'trainer-a'), 'opt-2' (client "
                        "'trainer-b')"));
  // Once one is gone another fits.
  ASSERT_TRUE(Unregister("opt-2", "trainer-b").ok());
  RegisterWithPlan("opt-3", "trainer-c");
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre("", "opt-3"));
}

TEST_F(OptimizerTableTest, RefusedRegistrationLeavesNoInstanceBehind) {
  MakeTable();
  v1::RegisterParamsRequest bad = RegisterRequest("opt-2", "trainer-b");
  bad.set_job_id("another-job");
  EXPECT_EQ(table_->Register(bad, {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre(""));
}

// A join that the coordinator keeps refusing (another daemon set squats the
// instance's job) holds up registrations of that name only: the default
// instance and another named one register meanwhile; the join ends within the
// registration's deadline with a message naming the instance, its job and the
// fix; nothing of it stays, so the name registers once the squatter is gone.
TEST_F(OptimizerTableTest, StuckJoinDelaysOnlyItsOwnNameAndEndsByTheDeadline) {
  MakeTable();
  absl::Notification joining;
  absl::Notification squatter_gone;
  std::atomic<int64_t> given_ms{-1};
  join_ = [&](const std::string& name, absl::Duration timeout) {
    if (name != "squatted") return absl::OkStatus();
    if (joining.HasBeenNotified()) return absl::OkStatus();  // the retry
    given_ms.store(absl::ToInt64Milliseconds(timeout));
    joining.Notify();
    if (squatter_gone.WaitForNotificationWithTimeout(timeout)) {
      return absl::OkStatus();
    }
    return absl::DeadlineExceededError(
        "Join refused: job 'job/squatted' rank 1 is already joined and live");
  };
  const v1::RegisterParamsRequest squatted =
      RegisterRequest("squatted", "trainer-s");
  const v1::RegisterParamsRequest first = RegisterRequest("", "trainer-a");
  const v1::RegisterParamsRequest other = RegisterRequest("opt-2", "trainer-b");
  const absl::Time deadline = absl::Now() + absl::Seconds(3);
  absl::StatusOr<v1::RegisterParamsResponse> refused;
  std::thread stuck(
      [&] { refused = table_->Register(squatted, {}, deadline); });
  joining.WaitForNotification();
  EXPECT_TRUE(table_->Register(first, {}).ok());
  EXPECT_TRUE(table_->Register(other, {}).ok());
  EXPECT_LT(absl::Now(), deadline - absl::Seconds(1));  // not held up
  stuck.join();
  EXPECT_LE(absl::Now(), deadline);
  EXPECT_LE(given_ms.load(), 2250);  // a margin left for the answer
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), HasSubstr("optimizer 'squatted'"));
  EXPECT_THAT(refused.status().message(), HasSubstr("job 'job/squatted'"));
  EXPECT_THAT(refused.status().message(), HasSubstr("already joined and live"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr("another name (muond.torch.Muon(name=...))"));
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre("", "opt-2"));
  squatter_gone.Notify();
  EXPECT_TRUE(
      table_->Register(RegisterRequest("squatted", "trainer-s"), {}).ok());
}

// A second registration of a name whose instance is still joining waits for
// that join, up to its own deadline, then says so.
TEST_F(OptimizerTableTest,
       SecondRegistrationOfAJoiningNameWaitsUpToItsDeadline) {
  MakeTable();
  absl::Notification joining;
  absl::Notification release;
  join_ = [&](const std::string&, absl::Duration) {
    joining.Notify();
    release.WaitForNotification();
    return absl::OkStatus();
  };
  const v1::RegisterParamsRequest first = RegisterRequest("opt-2", "trainer-a");
  const v1::RegisterParamsRequest again = first;
  absl::StatusOr<v1::RegisterParamsResponse> made;
  std::thread maker([&] { made = table_->Register(first, {}); });
  joining.WaitForNotification();
  absl::StatusOr<v1::RegisterParamsResponse> waited =
      table_->Register(again, {}, absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(waited.status().message(),
              HasSubstr("optimizer 'opt-2' is still joining"));
  release.Notify();
  maker.join();
  EXPECT_TRUE(made.ok()) << made.status();
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre("", "opt-2"));
}

// grpc.health.v1 (on_serving) and the Health RPC without a name are one
// value at every stage: none registered, one, a second without a plan yet
// (every registered instance must step), the first gone, shutdown.
TEST_F(OptimizerTableTest, HealthAgreesWithGrpcHealthAcrossRegistrations) {
  MakeTable();
  ExpectDaemonServing(false);
  EXPECT_TRUE(table_->Health({})->serving());
  // An instance its RegisterParams has yet to make: up, without a plan.
  v1::HealthRequest later;
  later.set_optimizer("later");
  ASSERT_TRUE(table_->Health(later).ok());
  EXPECT_TRUE(table_->Health(later)->serving());
  EXPECT_FALSE(table_->Health(later)->has_plan());
  EXPECT_THAT(table_->Names(), ::testing::ElementsAre(""));
  RegisterWithPlan("", "trainer-a");
  ExpectDaemonServing(true);
  ASSERT_TRUE(table_->Register(RegisterRequest("opt-2", "trainer-b"), {}).ok());
  ExpectDaemonServing(false);
  v1::HealthRequest second;
  second.set_optimizer("opt-2");
  EXPECT_FALSE(table_->Health(second)->has_plan());
  ASSERT_TRUE(Unregister("opt-2", "trainer-b").ok());
  ExpectDaemonServing(true);
  RegisterWithPlan("opt-2", "trainer-b");
  ExpectDaemonServing(true);
  ASSERT_TRUE(Unregister("", "trainer-a").ok());
  ExpectDaemonServing(true);
  table_->Shutdown();
  ExpectDaemonServing(false);
  EXPECT_FALSE(table_->Health({})->serving());
  EXPECT_FALSE(table_->Health(second)->serving());
}

// The table of one core (the service over a core, as tests and tools use
// it): a named instance is refused.
TEST_F(OptimizerTableTest, OneCoreTableRefusesNamedInstances) {
  auto link = std::make_shared<FakeLink>();
  DaemonConfig config;
  config.job_id = "job";
  DaemonCore core(
      config, std::make_unique<HandleOpener>(), link.get(),
      [](const Registration&, const v1::Plan&, const std::function<bool()>&)
          -> absl::StatusOr<std::unique_ptr<StepEngine>> {
        return absl::InternalError("no engine in this test");
      });
  OptimizerTable one(&core);
  absl::StatusOr<v1::RegisterParamsResponse> got =
      one.Register(RegisterRequest("opt-2", "trainer-b"), {});
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(got.status().message(), HasSubstr("optimizer 'opt-2'"));
  EXPECT_FALSE(one.Health({})->has_plan());
}

TEST(InstanceJobIdTest, CoordinatorAcceptsExactlyJobAndJobSlashName) {
  EXPECT_EQ(InstanceJobId("job", ""), "job");
  EXPECT_EQ(InstanceJobId("job", "opt-2"), "job/opt-2");
  EXPECT_TRUE(CheckCoordinatorJobId("job_id", "job").ok());
  EXPECT_TRUE(CheckCoordinatorJobId("job_id", "job/opt-2").ok());
  EXPECT_TRUE(CheckCoordinatorJobId(
                  "job_id", std::string(64, 'j') + "/" + std::string(64, 'n'))
                  .ok());
  for (const std::string& bad :
       {"job/", "/opt", "a/b/c", "job/sp ace", "", "job//x"}) {
    absl::Status st = CheckCoordinatorJobId("job_id", bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(st.message(), HasSubstr("job_id=")) << bad;
  }
  EXPECT_FALSE(CheckJobId("--job_id", "job/opt-2").ok());
}

}  // namespace
}  // namespace muond::daemon_core_test
