#include "core/comm/communicator.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/core/comm/exchange_pattern.h"

namespace muond {
namespace {

using ::muond::testing::Encode;

TEST(LocalCommunicator, CopiesSendToRecv) {
  LocalCommunicator comm;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.memory_space(), MemorySpace::kHost);
  std::vector<float> send = {1.5f, -2.0f, 3.25f};
  std::vector<float> recv(3, 0.0f);
  std::vector<int64_t> counts = {3};
  ASSERT_TRUE(
      comm.AllToAllV(send.data(), counts, recv.data(), counts, DType::kFloat32)
          .ok());
  EXPECT_EQ(recv, send);

  std::vector<uint16_t> send16 = {Encode<uint16_t>(0, 0, 0, 1),
                                  Encode<uint16_t>(0, 0, 1, 1)};
  std::vector<uint16_t> recv16(2, 0);
  ASSERT_TRUE(
      comm.AllGather(send16.data(), 2, recv16.data(), DType::kBFloat16).ok());
  EXPECT_EQ(recv16, send16);

  // Empty exchanges with null buffers.
  std::vector<int64_t> zero = {0};
  EXPECT_TRUE(
      comm.AllToAllV(nullptr, zero, nullptr, zero, DType::kFloat32).ok());
  EXPECT_TRUE(comm.AllGather(nullptr, 0, nullptr, DType::kBFloat16).ok());
  EXPECT_TRUE(comm.Barrier().ok());
  EXPECT_TRUE(comm.Wait().ok());
}

TEST(LocalCommunicator, FailsAfterAbort) {
  LocalCommunicator comm;
  comm.Abort();
  comm.Abort();  // idempotent
  float x = 1.0f, y = 0.0f;
  EXPECT_EQ(comm.AllGather(&x, 1, &y, DType::kFloat32).code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(comm.Barrier().code(), absl::StatusCode::kAborted);
}

TEST(Communicator, ValidatesCounts) {
  LocalCommunicator comm;
  float buf[4] = {};
  std::vector<int64_t> two = {1, 1}, one = {1}, negative = {-1}, three = {3};
  absl::Status st = comm.AllToAllV(buf, two, buf + 2, one, DType::kFloat32);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("send_counts"), std::string::npos) << st;
  st = comm.AllToAllV(buf, one, buf + 2, negative, DType::kFloat32);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("recv_counts[0]"), std::string::npos) << st;
  st = comm.AllToAllV(nullptr, one, buf, one, DType::kFloat32);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  st = comm.AllToAllV(buf, one, buf + 1, three, DType::kFloat32);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("send_counts[rank]"), std::string::npos) << st;
  EXPECT_EQ(comm.AllGather(buf, -1, buf, DType::kFloat32).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comm.AllGather(nullptr, 2, buf, DType::kFloat32).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ValidateRankAndSize, Rules) {
  EXPECT_TRUE(ValidateRankAndSize(0, 1).ok());
  EXPECT_TRUE(ValidateRankAndSize(3, 4).ok());
  EXPECT_FALSE(ValidateRankAndSize(0, 0).ok());
  EXPECT_FALSE(ValidateRankAndSize(4, 4).ok());
  EXPECT_FALSE(ValidateRankAndSize(-1, 4).ok());
}

}  // namespace
}  // namespace muond
