// Input guards through real processes (a coordinator and four
// host-mode muond daemons, 2x2 domain, trainers over shared memory):
//   * a trainer that shrinks (ftruncate) its registered shm object and steps
//     gets FailedPrecondition naming the region and both sizes; its daemon
//     survives (it died of SIGBUS before);
//   * a 10 MB param name is refused with a bounded message that reaches the
//     client as INVALID_ARGUMENT (echoed whole, it overflowed gRPC's
//     metadata limit).
// The pure rules (aliasing, other users' objects, shm names) are in
// tests/server/daemon/memory_guard_test.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/reliability/harness.h"

namespace muond::reliability {
namespace {

class InputGuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Short communicator timeout: the peers of the refusing rank wait at
    // most this long (until the job-wide vote refuses for all of them).
    Cluster::Options options;
    options.daemon_flags = {"--comm_timeout_s=5"};
    cluster_ = std::make_unique<Cluster>(options);
    cluster_->StartAll();
    trainers_ = std::make_unique<Trainers>(*cluster_);
  }

  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Trainers> trainers_;
};

TEST_F(InputGuardTest, ShrunkShmObjectIsRefusedAndTheDaemonSurvives) {
  ASSERT_TRUE(trainers_->RegisterAll().ok());
  ASSERT_TRUE(trainers_->RunSteps(1, 1).ok());
  const v1::MemoryRegion region = trainers_->Region(0);
  const int fd = shm_open(region.shm_name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << region.shm_name();
  ASSERT_EQ(ftruncate(fd, 0), 0);
  // No FillGrads: the trainer's own mapping is gone too.
  const std::vector<absl::StatusOr<v1::StepResponse>> steps =
      trainers_->StepAll(2);
  const absl::Status& refused = steps[0].status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(),
                                absl::StrCat("region '", region.name(), "'")))
      << refused;
  EXPECT_TRUE(absl::StrContains(
      refused.message(),
      absl::StrCat("shrank to 0 bytes, below the region's registered "
                   "byte_size ",
                   region.byte_size())))
      << refused;
  EXPECT_TRUE(cluster_->DaemonAlive(0));
  ASSERT_EQ(ftruncate(fd, region.byte_size()), 0);
  close(fd);
  EXPECT_TRUE(trainers_->client(0).Health().ok());
}

TEST_F(InputGuardTest, HugeNameIsRefusedWithABoundedMessage) {
  auto daemon = v1::Optimizer::NewStub(grpc::CreateChannel(
      "unix://" + cluster_->socket(0), grpc::InsecureChannelCredentials()));
  v1::RegisterParamsRequest req;
  req.set_job_id(cluster_->job());
  req.set_client_id("trainer0");
  *req.add_regions() = trainers_->Region(0);
  *req.add_groups() = trainers_->Group(0);
  req.mutable_groups(0)->mutable_params(0)->set_name(
      std::string(10 << 20, 'n'));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::RegisterParamsResponse resp;
  const grpc::Status st = daemon->RegisterParams(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << st.error_message().substr(0, 300);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "param name"))
      << st.error_message().substr(0, 300);
  EXPECT_TRUE(absl::StrContains(st.error_message(),
                                absl::StrCat("is ", 10 << 20, " bytes")));
  EXPECT_LT(st.error_message().size(), 1000u);
  EXPECT_TRUE(cluster_->DaemonAlive(0));
}

}  // namespace
}  // namespace muond::reliability
