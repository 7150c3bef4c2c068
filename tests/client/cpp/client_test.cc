// Client-side helpers: shm regions and TensorRefs for strided views.
#include "client/cpp/client.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

#include "client/cpp/shm_region.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

std::string UniqueName(const char* tag) {
  return "/muond-client-test-" + std::to_string(getpid()) + "-" + tag;
}

TEST(ShmRegion, CreateOpenShareBytesAndUnlinkOnDestroy) {
  const std::string name = UniqueName("a");
  auto region = ShmRegion::Create(name, 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(ShmRegion::Create(name, 4096).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto p = (*region)->Allocate(100);
  ASSERT_TRUE(p.ok());
  std::memcpy(*p, "hello", 6);
  {
    auto other = ShmRegion::Open(name);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ((*other)->size(), 4096u);
    EXPECT_STREQ(static_cast<const char*>((*other)->data()), "hello");
  }
  // Alignment and exhaustion.
  auto q = (*region)->Allocate(10, 256);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(static_cast<char*>(*q) - static_cast<char*>((*region)->data()),
            256);
  EXPECT_EQ((*region)->Allocate(4096).status().code(),
            absl::StatusCode::kResourceExhausted);
  region->reset();
  EXPECT_EQ(ShmRegion::Open(name).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmRegion, BadNamesRefused) {
  EXPECT_EQ(ShmRegion::Create("noslash", 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmRegion::Create("/a/b", 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmRegion::Create(UniqueName("z"), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HostRef, ColumnBlockIsStridedViewWithOffset) {
  auto region = ShmRegion::Create(UniqueName("b"), 8 * 6 * 4);
  ASSERT_TRUE(region.ok());
  float* full = static_cast<float*>((*region)->data());  // 8 x 6 row-major
  // Columns [3, 6) of rows [2, 8): a 6 x 3 block with row stride 6.
  auto ref =
      HostRef(**region, full + 2 * 6 + 3, v1::DTYPE_FP32, {6, 3}, {6, 1});
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->kind(), v1::HOST_SHM);
  EXPECT_EQ(ref->shm_name(), (*region)->name());
  EXPECT_EQ(ref->byte_offset(), (2 * 6 + 3) * 4u);
  EXPECT_EQ(ref->strides(0), 6);
  // Default strides are row-major.
  auto contiguous = HostRef(**region, full, v1::DTYPE_BF16, {4, 5});
  ASSERT_TRUE(contiguous.ok());
  EXPECT_EQ(contiguous->strides(0), 5);
  EXPECT_EQ(contiguous->strides(1), 1);
  // One row too many runs past the region.
  auto past =
      HostRef(**region, full + 2 * 6 + 3, v1::DTYPE_FP32, {7, 3}, {6, 1});
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(), HasSubstr("does not lie inside"));
  // Innermost stride must be 1.
  EXPECT_EQ(
      HostRef(**region, full, v1::DTYPE_FP32, {2, 2}, {6, 2}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(Client, ConnectNeedsJobIdAndStepFailsWithoutDaemon) {
  EXPECT_EQ(Client::Connect("unix:///nonexistent.sock", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ClientOptions options;
  options.job_id = "j";
  options.rpc_timeout = absl::Milliseconds(200);
  auto client =
      Client::Connect("unix:///tmp/muond-no-daemon-here.sock", options);
  ASSERT_TRUE(client.ok());
  EXPECT_FALSE((*client)->options().client_id.empty());
  EXPECT_FALSE((*client)->Step(1).ok());
}

}  // namespace
}  // namespace muond
