// A daemon's real GrpcCoordinatorLink against the real CoordinatorService on
// a Unix socket: a Join that finds the job held by another world size (a
// squatter) waits it out instead of failing, and fails naming the holder
// only at its deadline or once its caller is gone; a registration while the
// coordinator is unreachable is answered naming the coordinator's address.
#include "server/daemon/coordinator_link.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"
#include "server/coordinator/coordinator_service.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

v1::JoinRequest JoinOf(int rank, int world_size) {
  v1::JoinRequest join;
  join.set_job_id("job");
  join.set_rank(rank);
  join.set_world_size(world_size);
  join.set_host("localhost");
  return join;
}

v1::PublishManifestRequest OneRankManifest() {
  v1::PublishManifestRequest r;
  r.set_job_id("job");
  r.set_rank(0);
  v1::GroupManifest* g = r.add_groups();
  g->set_group("muon");
  g->set_algorithm(v1::ALGORITHM_MUON);
  g->mutable_domain()->set_name("dense");
  g->mutable_domain()->set_gtp_size(1);
  g->mutable_domain()->set_tp_size(1);
  v1::ParamSpec* p = g->add_params();
  p->set_name("w");
  for (int64_t dim : {8, 4}) {
    p->add_full_shape(dim);
    p->add_local_shape(dim);
  }
  return r;
}

class CoordinatorLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Not ::testing::TempDir(): under a deep output base its path outgrows
    // a Unix socket's 107 characters.
    char dir[] = "/tmp/muond-link-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    address_ = "unix://" + dir_ + "/coord.sock";
  }
  void TearDown() override {
    StopCoordinator();
    std::filesystem::remove_all(dir_);
  }

  void StartCoordinator(absl::Duration join_grace) {
    CoordinatorOptions options;
    options.join_grace = join_grace;
    options.planner = [](const v1::GroupManifest& m, v1::CostModel model,
                         const CostTable& costs) {
      return PlanGroup(m, model, costs);
    };
    core_ = std::make_unique<CoordinatorCore>(options);
    service_ = std::make_unique<CoordinatorService>(core_.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  }
  void StopCoordinator() {
    if (server_ == nullptr) return;
    service_->BeginShutdown();
    server_->Shutdown();
    server_.reset();
  }

  // A Join from outside the job (no plan stream).
  grpc::Status SquatterJoins(int world_size) {
    grpc::ClientContext context;
    v1::JoinResponse response;
    return stub_->Join(&context, JoinOf(0, world_size), &response);
  }

  std::string dir_;
  std::string address_;
  std::unique_ptr<CoordinatorCore> core_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorLinkTest, JoinWaitsOutASquatterOfAnotherWorldSize) {
  StartCoordinator(/*join_grace=*/absl::Seconds(1));
  ASSERT_TRUE(SquatterJoins(3).ok());
  // The squatter holds the job for its join grace; the daemon waits (its
  // deadline is far longer) and then joins with its own world size.
  GrpcCoordinatorLink link(address_, JoinOf(0, 2));
  ASSERT_TRUE(link.Start([](const v1::Plan&) {}, absl::Seconds(60)).ok());
  v1::ListDaemonsRequest list;
  list.set_job_id("job");
  absl::StatusOr<v1::ListDaemonsResponse> daemons = core_->ListDaemons(list);
  ASSERT_TRUE(daemons.ok()) << daemons.status();
  ASSERT_EQ(daemons->daemons_size(), 1);
  EXPECT_TRUE(daemons->daemons(0).live());
  link.Stop();
}

TEST_F(CoordinatorLinkTest, JoinGivesUpAtItsDeadlineNamingTheHolder) {
  StartCoordinator(/*join_grace=*/absl::Seconds(30));
  // The holder keeps its plan stream open: it stays live.
  GrpcCoordinatorLink holder(address_, JoinOf(0, 3));
  ASSERT_TRUE(holder.Start([](const v1::Plan&) {}, absl::Seconds(10)).ok());
  GrpcCoordinatorLink link(address_, JoinOf(1, 2));
  const absl::Status st =
      link.Start([](const v1::Plan&) {}, absl::Milliseconds(500));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(st.message(), HasSubstr("Join refused for 500ms"));
  EXPECT_THAT(st.message(), HasSubstr("held by 1 live daemon of world size 3"));
  EXPECT_THAT(st.message(), HasSubstr("another --job_id"));
  holder.Stop();
}

// The caller of a Join that waits out a holder may go away (a trainer's
// RegisterParams cancelled): the retries stop then, quoting the refusal.
TEST_F(CoordinatorLinkTest, JoinStopsRetryingOnceItsCallerIsGone) {
  StartCoordinator(/*join_grace=*/absl::Seconds(30));
  GrpcCoordinatorLink holder(address_, JoinOf(0, 3));
  ASSERT_TRUE(holder.Start([](const v1::Plan&) {}, absl::Seconds(10)).ok());
  GrpcCoordinatorLink link(address_, JoinOf(1, 2));
  // Gone after the first refusal: the deadline, far away, is not reached.
  int asked = 0;
  const absl::Status st =
      link.Start([](const v1::Plan&) {}, absl::Now() + absl::Minutes(5),
                 [&asked] { return ++asked > 1; });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(st.message(), HasSubstr("its caller went away"));
  EXPECT_THAT(st.message(), HasSubstr("held by 1 live daemon of world size 3"));
  EXPECT_EQ(asked, 2);
  holder.Stop();
}

TEST_F(CoordinatorLinkTest, RegistrationNamesTheCoordinatorThatWentAway) {
  StartCoordinator(/*join_grace=*/absl::Seconds(30));
  GrpcCoordinatorLink link(address_, JoinOf(0, 1));
  ASSERT_TRUE(link.Start([](const v1::Plan&) {}, absl::Seconds(10)).ok());
  StopCoordinator();
  const absl::StatusOr<int64_t> round =
      link.PublishRegistration(OneRankManifest());
  EXPECT_EQ(round.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(round.status().message(),
              HasSubstr("the coordinator at " + address_ +
                        " (--coordinator) is unreachable"));
  link.Stop();
}

TEST_F(CoordinatorLinkTest, RegistrationBeforeJoinNamesTheCoordinator) {
  // Nothing listens: Start keeps retrying meanwhile.
  GrpcCoordinatorLink link(address_, JoinOf(0, 1));
  std::thread starting([&link] {
    EXPECT_EQ(link.Start([](const v1::Plan&) {}, absl::Seconds(3)).code(),
              absl::StatusCode::kUnavailable);
  });
  const absl::StatusOr<int64_t> round =
      link.PublishRegistration(OneRankManifest());
  EXPECT_EQ(round.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(round.status().message(),
              HasSubstr("the coordinator at " + address_ +
                        " (--coordinator) is unreachable"));
  starting.join();
  link.Stop();
}

}  // namespace
}  // namespace muond
