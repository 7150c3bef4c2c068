// NCCL communicator across GPUs: one forked process per GPU (up to 4),
// rendezvous through a FileKeyValueStore. The parent never touches CUDA
// (a CUDA context does not survive fork); a forked probe counts devices.
// Skips with fewer than 2 GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "core/comm/kv_store.h"
#include "core/comm/nccl_communicator.h"
#include "tests/common/cuda_device.h"
#include "tests/core/comm/exchange_pattern.h"
#include "tests/core/comm/multiprocess.h"

namespace muond {
namespace {

using ::muond::testing::ExpectedRecv;
using ::muond::testing::IdleRankOneCount;
using ::muond::testing::MakeTempDir;
using ::muond::testing::RunRanks;
using ::muond::testing::SameBytes;
using ::muond::testing::SendBuffer;
using ::muond::testing::UnevenCount;

int DeviceCountInChild() {
  std::vector<int> codes = RunRanks(
      1, [](int) { return std::min(muond::testing::CudaDeviceCount(), 100); });
  return codes[0];
}

int Fail(int rank, const char* what, const absl::Status& st) {
  std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, st.ToString().c_str());
  return 1;
}

// Creates the group's communicator on GPU `rank` with a fresh stream.
absl::StatusOr<std::unique_ptr<Communicator>> Join(const std::string& dir,
                                                   const std::string& prefix,
                                                   int rank, int size,
                                                   cudaStream_t* stream) {
  if (cudaSetDevice(rank) != cudaSuccess ||
      cudaStreamCreate(stream) != cudaSuccess) {
    return absl::InternalError("cannot set device / create stream");
  }
  FileKeyValueStore store(dir);
  NcclOptions options;
  options.timeout = absl::Seconds(20);
  return CreateNcclCommunicator(&store, prefix, rank, size, *stream, options);
}

template <typename T>
DType DTypeOf() {
  return sizeof(T) == 2 ? DType::kBFloat16 : DType::kFloat32;
}

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* dev = nullptr;
  cudaMalloc(&dev, std::max<size_t>(1, host.size()) * sizeof(T));
  if (!host.empty()) {
    cudaMemcpy(dev, host.data(), host.size() * sizeof(T),
               cudaMemcpyHostToDevice);
  }
  return dev;
}

template <typename T, typename CountFn>
int AllToAllRounds(Communicator& comm, CountFn count) {
  const int rank = comm.rank(), size = comm.size();
  for (int round = 0; round < 3; ++round) {
    std::vector<int64_t> send_counts, recv_counts;
    std::vector<T> send = SendBuffer<T>(rank, size, round, count, &send_counts);
    std::vector<T> want =
        ExpectedRecv<T>(rank, size, round, count, &recv_counts);
    T* d_send = ToDevice(send);
    T* d_recv = ToDevice(std::vector<T>(want.size(), T{}));
    absl::Status st =
        comm.AllToAllV(d_send, send_counts, d_recv, recv_counts, DTypeOf<T>());
    if (st.ok()) st = comm.Wait();
    if (!st.ok()) return Fail(rank, "all_to_allv", st);
    std::vector<T> got(want.size());
    if (!got.empty()) {
      cudaMemcpy(got.data(), d_recv, got.size() * sizeof(T),
                 cudaMemcpyDeviceToHost);
    }
    cudaFree(d_send);
    cudaFree(d_recv);
    if (!SameBytes(got, want)) {
      std::fprintf(stderr, "rank %d round %d: wrong result\n", rank, round);
      return 2;
    }
  }
  return 0;
}

template <typename T>
int AllGatherOnce(Communicator& comm) {
  const int rank = comm.rank(), size = comm.size();
  const int64_t count = 5;
  std::vector<T> send, want;
  for (int64_t i = 0; i < count; ++i) {
    send.push_back(testing::Encode<T>(rank, 0, i, 3));
  }
  for (int src = 0; src < size; ++src) {
    for (int64_t i = 0; i < count; ++i) {
      want.push_back(testing::Encode<T>(src, 0, i, 3));
    }
  }
  T* d_send = ToDevice(send);
  T* d_recv = ToDevice(std::vector<T>(want.size(), T{}));
  absl::Status st = comm.AllGather(d_send, count, d_recv, DTypeOf<T>());
  if (st.ok()) st = comm.Wait();
  if (!st.ok()) return Fail(rank, "all_gather", st);
  std::vector<T> got(want.size());
  cudaMemcpy(got.data(), d_recv, got.size() * sizeof(T),
             cudaMemcpyDeviceToHost);
  cudaFree(d_send);
  cudaFree(d_recv);
  return SameBytes(got, want) ? 0 : 3;
}

class NcclMultiGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    size_ = std::min(DeviceCountInChild(), 4);
    if (size_ < 2) GTEST_SKIP() << "needs >= 2 CUDA devices";
  }
  int size_ = 0;
};

TEST_F(NcclMultiGpu, CollectivesMatchTheExpectedExchange) {
  const std::string dir = MakeTempDir();
  std::vector<int> codes = RunRanks(size_, [&](int rank) {
    cudaStream_t stream;
    auto comm = Join(dir, "job/nccl", rank, size_, &stream);
    if (!comm.ok()) return Fail(rank, "create", comm.status());
    int code = AllToAllRounds<float>(**comm, UnevenCount);
    if (code == 0) code = AllToAllRounds<uint16_t>(**comm, UnevenCount);
    if (code == 0) code = AllToAllRounds<float>(**comm, IdleRankOneCount);
    if (code == 0) code = AllGatherOnce<float>(**comm);
    if (code == 0) code = AllGatherOnce<uint16_t>(**comm);
    if (code == 0) {
      absl::Status st = (*comm)->Barrier();
      if (!st.ok()) code = Fail(rank, "barrier", st);
    }
    comm->reset();
    return code;
  });
  EXPECT_EQ(codes, std::vector<int>(size_, 0));
}

// The last rank exits after init; the others' all_to_allv cannot complete,
// so Wait() aborts the communicator and reports an error within its timeout.
TEST_F(NcclMultiGpu, PeerThatExitsMakesSurvivorsFail) {
  const std::string dir = MakeTempDir();
  std::vector<int> codes = RunRanks(size_, [&](int rank) {
    cudaStream_t stream;
    if (cudaSetDevice(rank) != cudaSuccess ||
        cudaStreamCreate(&stream) != cudaSuccess) {
      return 40;
    }
    FileKeyValueStore store(dir);
    NcclOptions options;
    options.timeout = absl::Seconds(5);
    auto comm = CreateNcclCommunicator(&store, "job/dead", rank, size_, stream,
                                       options);
    if (!comm.ok()) return Fail(rank, "create", comm.status());
    absl::Status st = (*comm)->Barrier();
    if (!st.ok()) return Fail(rank, "first barrier", st);
    if (rank == size_ - 1) _exit(0);
    std::vector<float> host(size_, 1.0f);
    float* d_send = ToDevice(host);
    float* d_recv = ToDevice(host);
    std::vector<int64_t> counts(size_, 1);
    st = (*comm)->AllToAllV(d_send, counts, d_recv, counts, DType::kFloat32);
    if (st.ok()) st = (*comm)->Wait();
    std::fprintf(stderr, "rank %d got (expected an error): %s\n", rank,
                 st.ToString().c_str());
    if (st.ok()) return 41;
    if (!absl::StrContains(st.message(), "job/dead")) return 42;
    if ((*comm)->Barrier().code() != absl::StatusCode::kAborted) {
      return 43;
    }
    return 0;
  });
  EXPECT_EQ(codes, std::vector<int>(size_, 0));
}

}  // namespace
}  // namespace muond
