// A refused registration round reaches every rank at once: the
// real CoordinatorService on a Unix socket and two daemons' real
// GrpcCoordinatorLinks. Rank 0 publishes first; rank 1's manifest disagrees
// (another full shape) and its publish is refused; rank 0's plan stream
// carries the refusal, with the reason, within a second (not the 30 s its
// trainer would wait for a plan), and a later registration of rank 0 is not
// failed by it.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"
#include "server/coordinator/coordinator_service.h"
#include "server/daemon/coordinator_link.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

v1::PublishManifestRequest DdpManifest(int rank, int64_t rows) {
  v1::PublishManifestRequest r;
  r.set_job_id("job");
  r.set_rank(rank);
  v1::GroupManifest* g = r.add_groups();
  g->set_group("muon");
  g->set_algorithm(v1::ALGORITHM_MUON);
  v1::Domain* d = g->mutable_domain();
  d->set_name("dense");
  d->set_gtp_size(1);
  d->set_tp_size(1);
  d->set_dp_size(2);
  d->set_d(rank);
  v1::ParamSpec* p = g->add_params();
  p->set_name("w");
  for (int64_t dim : {rows, int64_t{32}}) {
    p->add_full_shape(dim);
    p->add_local_shape(dim);
  }
  return r;
}

// What a daemon's plan stream delivered.
struct Received {
  absl::Mutex mu;
  std::optional<v1::Plan> refusal ABSL_GUARDED_BY(mu);
  int plans ABSL_GUARDED_BY(mu) = 0;
  void On(const v1::Plan& plan) {
    absl::MutexLock lock(&mu);
    if (plan.round_refused().empty()) {
      ++plans;
    } else {
      refusal = plan;
    }
  }
  // The refusal, once it came within `timeout`.
  std::optional<v1::Plan> WaitRefusal(absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    auto came = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return refusal.has_value();
    };
    mu.AwaitWithTimeout(absl::Condition(&came), timeout);
    return refusal;
  }
};

class RoundRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions options;
    options.planner = [](const v1::GroupManifest& m, v1::CostModel model,
                         const CostTable& costs) {
      return PlanGroup(m, model, costs);
    };
    core_ = std::make_unique<CoordinatorCore>(options);
    service_ = std::make_unique<CoordinatorService>(core_.get());
    // Not ::testing::TempDir(): under a deep output base its path outgrows
    // a Unix socket's 107 characters.
    char dir[] = "/tmp/muond-refusal-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    socket_ = dir_ + "/coord.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix://" + socket_,
                             grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    for (int rank = 0; rank < 2; ++rank) {
      v1::JoinRequest join;
      join.set_job_id("job");
      join.set_rank(rank);
      join.set_world_size(2);
      join.set_host("localhost");
      links_[rank] =
          std::make_unique<GrpcCoordinatorLink>("unix://" + socket_, join);
      Received* got = &received_[rank];
      ASSERT_TRUE(links_[rank]
                      ->Start([got](const v1::Plan& p) { got->On(p); },
                              absl::Seconds(10))
                      .ok());
    }
  }
  void TearDown() override {
    for (auto& link : links_) link->Stop();
    service_->BeginShutdown();
    server_->Shutdown();
    std::filesystem::remove_all(dir_);
  }

  std::unique_ptr<CoordinatorCore> core_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string dir_;
  std::string socket_;
  std::unique_ptr<GrpcCoordinatorLink> links_[2];
  Received received_[2];
};

TEST_F(RoundRefusalTest, EveryRankHearsTheRefusalAtOnce) {
  ASSERT_TRUE(links_[0]->PublishRegistration(DdpManifest(0, 64)).ok());
  const absl::Time refused_at = absl::Now();
  const absl::StatusOr<int64_t> refused =
      links_[1]->PublishRegistration(DdpManifest(1, 128));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("full_shape [64, 32] vs [128, 32]"));

  const std::optional<v1::Plan> refusal =
      received_[0].WaitRefusal(absl::Seconds(1));
  ASSERT_TRUE(refusal.has_value())
      << "rank 0 did not hear of the refusal within a second";
  EXPECT_LT(absl::Now() - refused_at, absl::Seconds(1));
  EXPECT_EQ(refusal->version(), 0);
  EXPECT_EQ(refusal->groups_size(), 0);
  EXPECT_THAT(refusal->round_refused(),
              HasSubstr("registration round refused at rank 1: "));
  EXPECT_THAT(refusal->round_refused(),
              HasSubstr("rank 0 and rank 1 (replicas d=0 and d=1 of (g=0, "
                        "t=0)) differ at param #0 'w': full_shape [64, 32] vs "
                        "[128, 32]"));
  // Rank 1's own attempt was refused in its answer; its stream passes the
  // refusal of that attempt on too.
  EXPECT_TRUE(received_[1].WaitRefusal(absl::Seconds(1)).has_value());
  // The refusal is no plan.
  EXPECT_EQ(core_->GetPlan("job").status().code(), absl::StatusCode::kNotFound);

  // Both register again with agreeing manifests: a plan, and no refusal of
  // the new registrations.
  {
    absl::MutexLock lock(&received_[0].mu);
    received_[0].refusal.reset();
  }
  ASSERT_TRUE(links_[0]->PublishRegistration(DdpManifest(0, 64)).ok());
  ASSERT_TRUE(links_[1]->PublishRegistration(DdpManifest(1, 64)).ok());
  ASSERT_TRUE(core_->GetPlan("job").ok());
  EXPECT_FALSE(received_[0].WaitRefusal(absl::Milliseconds(500)).has_value());
}

// A refusal that dropped none of a rank's registrations (it had not
// published in the round) is not passed on to that daemon.
TEST_F(RoundRefusalTest, ARankWithoutADroppedRegistrationIgnoresIt) {
  ASSERT_TRUE(links_[0]->PublishRegistration(DdpManifest(0, 64)).ok());
  ASSERT_FALSE(links_[1]->PublishRegistration(DdpManifest(1, 128)).ok());
  ASSERT_TRUE(received_[0].WaitRefusal(absl::Seconds(1)).has_value());
  // A second refusal of rank 1 alone: rank 0's registration was already
  // dropped by the first, so this one is not rank 0's.
  {
    absl::MutexLock lock(&received_[0].mu);
    received_[0].refusal.reset();
  }
  ASSERT_FALSE(links_[1]->PublishRegistration(DdpManifest(1, 0)).ok());
  ASSERT_TRUE(received_[1].WaitRefusal(absl::Seconds(1)).has_value());
  EXPECT_FALSE(received_[0].WaitRefusal(absl::Milliseconds(500)).has_value());
}

// A daemon's own refusal of its trainer's registration (PublishRefusal, what
// DaemonCore::Register sends) reaches the rank that already published within
// a second, and a rank publishing after it is refused at once.
TEST_F(RoundRefusalTest, ADaemonsOwnRefusalReachesEveryRank) {
  ASSERT_TRUE(links_[0]->PublishRegistration(DdpManifest(0, 64)).ok());
  const absl::Time refused_at = absl::Now();
  ASSERT_TRUE(links_[1]->PublishRefusal("param 'w' param: bad view").ok());
  const std::optional<v1::Plan> refusal =
      received_[0].WaitRefusal(absl::Seconds(1));
  ASSERT_TRUE(refusal.has_value())
      << "rank 0 did not hear of rank 1's refusal within a second";
  EXPECT_LT(absl::Now() - refused_at, absl::Seconds(1));
  EXPECT_EQ(refusal->round_refused(),
            "rank 1 refused its trainer's registration: param 'w' param: bad "
            "view");
  // The refusing daemon has no registration to be told about.
  EXPECT_FALSE(received_[1].WaitRefusal(absl::Milliseconds(200)).has_value());

  // The retry: both register again, the refusing rank first.
  ASSERT_TRUE(links_[1]->PublishRegistration(DdpManifest(1, 64)).ok());
  ASSERT_TRUE(links_[0]->PublishRegistration(DdpManifest(0, 64)).ok());
  EXPECT_TRUE(core_->GetPlan("job").ok());
}

// Rank 1 refuses its trainer's registration before rank 0 published: rank 0's
// new registration is not refused for publishing first (it waited for a plan
// forever, bad_input_test's race); it starts the round rank 1's new one joins.
TEST_F(RoundRefusalTest, ARankPublishingAfterTheRefusalStartsTheNextRound) {
  ASSERT_TRUE(links_[1]->PublishRefusal("param 'w': bad gtp_rows").ok());
  const absl::StatusOr<int64_t> first =
      links_[0]->PublishRegistration(DdpManifest(0, 64));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(core_->GetPlan("job").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(links_[1]->PublishRegistration(DdpManifest(1, 64)).ok());
  absl::StatusOr<v1::Plan> plan = core_->GetPlan("job");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->version(), *first);
}

}  // namespace
}  // namespace muond
