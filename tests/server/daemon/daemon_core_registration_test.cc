// DaemonCore's RegisterParams / UnregisterParams: the manifest it publishes,
// who may clear a registration, and refusals that register nothing (the
// ones that end the job's round reach the coordinator).
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/server/daemon/daemon_core_fixture.h"

namespace muond::daemon_core_test {
namespace {

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
  // The job's size, which a local-mode trainer compares with its own world.
  EXPECT_EQ(core_->Status().world_size(), 4);
  // A second registration needs an unregister first.
  EXPECT_EQ(core_->Register(Valid()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A trainer that died without unregistering leaves its params
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
  // The operator is the token's: a constant or another token's id is not.
  for (const std::string other :
       {std::string("muonctl:operator"), OperatorClientId("another-token")}) {
    un.set_client_id(other);
    EXPECT_EQ(core_->Unregister(un).code(), absl::StatusCode::kPermissionDenied)
        << other;
  }
  EXPECT_EQ(core_->Status().num_params(), 2);
  un.set_client_id(OperatorClientId(kJobToken));
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

  // A symbolic link and a directory in /dev/shm: the name is wrong, not
  // the daemon (neither is a retryable UNAVAILABLE).
  const std::string odd = absl::StrCat("muond-registration-test-odd-", getpid(),
                                       "-", absl::ToUnixNanos(absl::Now()));
  ASSERT_EQ(symlink(("/dev/shm" + name_).c_str(),
                    ("/dev/shm/" + odd + "-link").c_str()),
            0);
  ASSERT_EQ(mkdir(("/dev/shm/" + odd + "-dir").c_str(), 0700), 0);
  r = Valid();
  r.mutable_regions(0)->set_shm_name("/" + odd + "-link");
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "symbolic link");
  r = Valid();
  r.mutable_regions(0)->set_shm_name("/" + odd + "-dir");
  ExpectRefused(r, absl::StatusCode::kFailedPrecondition, "not a regular");
  unlink(("/dev/shm/" + odd + "-link").c_str());
  rmdir(("/dev/shm/" + odd + "-dir").c_str());

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

// An unreachable coordinator refused nothing: the answer is the link's,
// naming the coordinator, without "refused".
TEST_F(DaemonCoreTest, UnreachableCoordinatorIsNotCalledARefusal) {
  link_.publish_status = absl::UnavailableError(
      "the coordinator at 10.0.0.1:7070 (--coordinator) is unreachable");
  absl::StatusOr<v1::RegisterParamsResponse> r = core_->Register(Valid());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(), HasSubstr("10.0.0.1:7070"));
  EXPECT_THAT(r.status().message(), ::testing::Not(HasSubstr("refused")));
  EXPECT_EQ(core_->Status().num_params(), 0);
}

}  // namespace
}  // namespace muond::daemon_core_test
