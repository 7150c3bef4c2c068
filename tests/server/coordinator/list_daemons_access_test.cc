// ListDaemons over the real CoordinatorService on a Unix socket: on an
// untokened coordinator other hosts reach (addresses_need_token), a caller
// that proved no token gets ranks and liveness but no daemon addresses; a
// job's members (its token) and every caller of a tokened coordinator see
// them.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "server/common/auth.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"
#include "server/coordinator/coordinator_service.h"

namespace muond {
namespace {

class ListDaemonsAccessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Not ::testing::TempDir(): under a deep output base its path outgrows
    // a Unix socket's 107 characters.
    char dir[] = "/tmp/muond-list-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override {
    if (server_ != nullptr) {
      service_->BeginShutdown();
      server_->Shutdown();
    }
    std::filesystem::remove_all(dir_);
  }

  void Serve(const std::string& coordinator_token, bool addresses_need_token) {
    CoordinatorOptions options;
    options.token = coordinator_token;
    options.planner = [](const v1::GroupManifest& m, v1::CostModel model,
                         const CostTable& costs) {
      return PlanGroup(m, model, costs);
    };
    core_ = std::make_unique<CoordinatorCore>(options);
    service_ = std::make_unique<CoordinatorService>(
        core_.get(), coordinator_token, addresses_need_token);
    const std::string address = "unix://" + dir_ + "/coord.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }

  // Rank 0 of `job` (world size 1) joins with `token`.
  void JoinRank0(const std::string& job, const std::string& token) {
    v1::JoinRequest join;
    join.set_job_id(job);
    join.set_world_size(1);
    join.set_address("unix:///run/muond/" + job + ".sock");
    join.set_token(token);
    ASSERT_TRUE(core_->Join(join).ok());
  }

  // ListDaemons of `job` sending `token` (none when empty).
  grpc::Status List(const std::string& job, const std::string& token,
                    v1::ListDaemonsResponse* response) {
    grpc::ClientContext context;
    AttachToken(&context, token);
    v1::ListDaemonsRequest request;
    request.set_job_id(job);
    return stub_->ListDaemons(&context, request, response);
  }

  std::string dir_;
  std::unique_ptr<CoordinatorCore> core_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(ListDaemonsAccessTest, UntokenedCallersGetRanksAndLivenessOnly) {
  Serve(/*coordinator_token=*/"", /*addresses_need_token=*/true);
  JoinRank0("open", "");
  for (const std::string& token : {std::string(), std::string("made-up")}) {
    v1::ListDaemonsResponse list;
    ASSERT_TRUE(List("open", token, &list).ok());
    ASSERT_EQ(list.daemons_size(), 1);
    EXPECT_EQ(list.daemons(0).rank(), 0);
    EXPECT_TRUE(list.daemons(0).live());
    EXPECT_EQ(list.daemons(0).address(), "") << "token '" << token << "'";
  }
  // A job with a token: its members see the addresses, others nothing.
  JoinRank0("closed", "job-secret");
  v1::ListDaemonsResponse list;
  ASSERT_TRUE(List("closed", "job-secret", &list).ok());
  ASSERT_EQ(list.daemons_size(), 1);
  EXPECT_EQ(list.daemons(0).address(), "unix:///run/muond/closed.sock");
  EXPECT_EQ(List("closed", "", &list).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(ListDaemonsAccessTest, TokenedCoordinatorListsAddressesToItsCallers) {
  Serve(/*coordinator_token=*/"secret", /*addresses_need_token=*/true);
  JoinRank0("j", "secret");
  v1::ListDaemonsResponse list;
  ASSERT_TRUE(List("j", "secret", &list).ok());
  ASSERT_EQ(list.daemons_size(), 1);
  EXPECT_EQ(list.daemons(0).address(), "unix:///run/muond/j.sock");
  EXPECT_EQ(List("j", "", &list).error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(ListDaemonsAccessTest, ThisHostOnlyCoordinatorListsAddresses) {
  Serve(/*coordinator_token=*/"", /*addresses_need_token=*/false);
  JoinRank0("j", "");
  v1::ListDaemonsResponse list;
  ASSERT_TRUE(List("j", "", &list).ok());
  ASSERT_EQ(list.daemons_size(), 1);
  EXPECT_EQ(list.daemons(0).address(), "unix:///run/muond/j.sock");
}

}  // namespace
}  // namespace muond
