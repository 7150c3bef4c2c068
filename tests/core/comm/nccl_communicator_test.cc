// NCCL communicator on one GPU: a group of one (no communication, copies on
// the stream) and argument checks. Skips without a CUDA device.
#include "core/comm/nccl_communicator.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/comm/kv_store.h"
#include "tests/common/cuda_device.h"
#include "tests/core/comm/exchange_pattern.h"

namespace muond {
namespace {

using ::muond::testing::Encode;

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* dev = nullptr;
  EXPECT_EQ(cudaMalloc(&dev, std::max<size_t>(1, host.size()) * sizeof(T)),
            cudaSuccess);
  if (!host.empty()) {
    EXPECT_EQ(cudaMemcpy(dev, host.data(), host.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return dev;
}

template <typename T>
std::vector<T> ToHost(const T* dev, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

TEST(NcclCommunicator, SizeOneCopiesOnTheStreamWithoutAStore) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(NcclAvailable());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  auto comm = CreateNcclCommunicator(nullptr, "job/one", 0, 1, stream);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->size(), 1);
  EXPECT_EQ((*comm)->memory_space(), MemorySpace::kDevice);

  std::vector<float> send = {1.5f, -2.0f, 3.25f, 7.0f};
  float* d_send = ToDevice(send);
  float* d_recv = ToDevice(std::vector<float>(4, 0.0f));
  std::vector<int64_t> counts = {4};
  ASSERT_TRUE(
      (*comm)->AllToAllV(d_send, counts, d_recv, counts, DType::kFloat32).ok());
  ASSERT_TRUE((*comm)->Wait().ok());
  EXPECT_EQ(ToHost(d_recv, 4), send);

  std::vector<uint16_t> send16 = {Encode<uint16_t>(0, 0, 0, 2),
                                  Encode<uint16_t>(0, 0, 1, 2),
                                  Encode<uint16_t>(0, 0, 2, 2)};
  uint16_t* d_send16 = ToDevice(send16);
  uint16_t* d_recv16 = ToDevice(std::vector<uint16_t>(3, 0));
  ASSERT_TRUE((*comm)->AllGather(d_send16, 3, d_recv16, DType::kBFloat16).ok());
  ASSERT_TRUE((*comm)->Barrier().ok());
  ASSERT_TRUE((*comm)->Wait().ok());
  EXPECT_EQ(ToHost(d_recv16, 3), send16);

  std::vector<int64_t> zero = {0};
  EXPECT_TRUE(
      (*comm)->AllToAllV(nullptr, zero, nullptr, zero, DType::kFloat32).ok());
  (*comm)->Abort();
  EXPECT_EQ((*comm)->AllGather(d_send, 1, d_recv, DType::kFloat32).code(),
            absl::StatusCode::kAborted);
  comm->reset();
  cudaFree(d_send);
  cudaFree(d_recv);
  cudaFree(d_send16);
  cudaFree(d_recv16);
  cudaStreamDestroy(stream);
}

// Rank 0 of a group of two whose peer never comes: the non-blocking init is
// polled until the timeout, then aborted, and DeadlineExceeded comes back.
TEST(NcclCommunicator, AbsentPeerTimesOutAtInit) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  InMemoryKeyValueStore store;
  NcclOptions options;
  options.timeout = absl::Seconds(3);
  auto comm =
      CreateNcclCommunicator(&store, "job/absent", 0, 2, stream, options);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_NE(comm.status().message().find("job/absent"), std::string::npos)
      << comm.status();
  // Rank 0 did publish the unique id, base64-encoded.
  absl::StatusOr<std::string> id =
      store.Get("job/absent/nccl/unique_id", absl::Seconds(1));
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_FALSE(id->empty());
  cudaStreamDestroy(stream);
}

// A non-zero rank waits for rank 0's unique id; none comes.
TEST(NcclCommunicator, MissingUniqueIdTimesOutNamingTheKey) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  InMemoryKeyValueStore store;
  NcclOptions options;
  options.timeout = absl::Milliseconds(300);
  auto comm =
      CreateNcclCommunicator(&store, "job/noid", 1, 2, nullptr, options);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(comm.status().message().find("job/noid/nccl/unique_id"),
            std::string::npos)
      << comm.status();
}

TEST(NcclCommunicator, RejectsBadArguments) {
  InMemoryKeyValueStore store;
  EXPECT_EQ(CreateNcclCommunicator(&store, "p", 1, 1, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  NcclOptions zero;
  zero.timeout = absl::ZeroDuration();
  EXPECT_EQ(
      CreateNcclCommunicator(&store, "p", 0, 2, nullptr, zero).status().code(),
      absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace muond
