// CudaBackend::RunGraph's cache and fallback (tag gpu; skipped without a
// device): a replay reads the buffers' current data; one key more than
// kCudaGraphsKept evicts the least recently used one, which runs directly
// when it comes back (no recapture per step); work that cannot be
// captured (a host synchronisation) runs directly, once per call, and its key
// is never captured again; a RunGraph inside another's work is part of it;
// with CudaBackendOptions::cuda_graphs off (muond-daemon --nocuda_graphs)
// every RunGraph runs its work directly.
#include <gtest/gtest.h>

#include <vector>

#include "core/backend/bf16.h"
#include "core/backend/cuda_backend.h"
#include "tests/common/cuda_device.h"

namespace muond {
namespace {

class CudaRunGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!muond::testing::HaveCudaDevice())
      GTEST_SKIP() << "no CUDA device on this machine";
    auto b = MakeCudaBackend(0, options_);
    ASSERT_TRUE(b.ok()) << b.status();
    gpu_ = std::move(*b);
    src_ = ContiguousView(*gpu_->Allocate(kN * 4), DType::kFloat32, 1, kN);
    dst_ = ContiguousView(*gpu_->Allocate(kN * 2), DType::kBFloat16, 1, kN);
  }
  void TearDown() override {
    if (gpu_ == nullptr) return;
    gpu_->Free(src_.data);
    gpu_->Free(dst_.data);
  }
  // Writes `value` into src and poisons dst.
  void Fill(float value) {
    host_.assign(kN, value);
    ASSERT_TRUE(gpu_->CopyFromHost(src_.data, host_.data(), kN * 4).ok());
    ASSERT_TRUE(gpu_->Memset0(dst_).ok());
    ASSERT_TRUE(gpu_->Synchronize().ok());
  }
  // dst as floats.
  std::vector<float> Dst() {
    std::vector<uint16_t> bits(kN);
    EXPECT_TRUE(gpu_->CopyToHost(bits.data(), dst_.data, kN * 2).ok());
    std::vector<float> out;
    for (uint16_t b : bits) out.push_back(Bf16BitsToFloat(b));
    return out;
  }
  absl::Status Convert(uint64_t key) {
    return gpu_->RunGraph(key, [&] { return gpu_->Copy2D(dst_, src_); });
  }
  CudaGraphCounts Counts() const { return GetCudaGraphCounts(*gpu_); }
  // dst after converting `value` (rounded once to bf16: past 256 not every
  // integer is a bf16).
  static std::vector<float> Want(float value) {
    return std::vector<float>(kN, RoundToBf16(value));
  }
  // `steps` rounds of keys 1..keys in order, as a step's groups replay, each
  // converting a value of its own (step * stride + key) and checked.
  void CycleKeys(int steps, uint64_t keys, float stride) {
    for (int step = 0; step < steps; ++step) {
      for (uint64_t key = 1; key <= keys; ++key) {
        Fill(float(step * stride + key));
        ASSERT_TRUE(Convert(key).ok());
        ASSERT_EQ(Dst(), Want(float(step * stride + key)));
      }
    }
  }

  static constexpr int64_t kN = 1000;
  CudaBackendOptions options_;  // set before SetUp by a subclass
  std::unique_ptr<Backend> gpu_;
  MatrixView src_, dst_;
  std::vector<float> host_;
};

TEST_F(CudaRunGraphTest, ReplayReadsFreshDataAndLruEvictsOldest) {
  constexpr int64_t kKept = kCudaGraphsKept;
  for (uint64_t key = 1; key <= kKept; ++key) {
    Fill(float(key));
    ASSERT_TRUE(Convert(key).ok());
    ASSERT_EQ(Dst(), Want(float(key)));
  }
  EXPECT_EQ(Counts().captures, kKept);
  // Key 1 replayed with new data (now the most recent; 2 the oldest).
  Fill(-3.0f);
  ASSERT_TRUE(Convert(1).ok());
  EXPECT_EQ(Dst(), std::vector<float>(kN, -3.0f));
  EXPECT_EQ(Counts().captures, kKept);
  // One key more evicts key 2; key 2, back, runs directly (not captured
  // again, evicting another), key 1 still replays.
  ASSERT_TRUE(Convert(kKept + 1).ok());
  EXPECT_EQ(Counts().captures, kKept + 1);
  Fill(5.0f);
  ASSERT_TRUE(Convert(2).ok());
  EXPECT_EQ(Dst(), std::vector<float>(kN, 5.0f));
  EXPECT_EQ(Counts().captures, kKept + 1);
  EXPECT_EQ(Counts().uncached, 1);
  ASSERT_TRUE(Convert(1).ok());
  EXPECT_EQ(Counts().captures, kKept + 1);
  EXPECT_EQ(Counts().launches, kKept + 3);
  EXPECT_EQ(Counts().fallbacks, 0);
}

// More keys in use than execs kept, cycled as a step's groups are: the keys
// evicted in the first cycle run directly after, the others replay; no key
// is captured twice.
TEST_F(CudaRunGraphTest, MoreKeysThanKeptCaptureEachOnceAtMost) {
  constexpr int64_t kKeys = kCudaGraphsKept + 10;
  ASSERT_NO_FATAL_FAILURE(CycleKeys(3, kKeys, 10000));
  EXPECT_EQ(Counts().captures, kKeys);
  EXPECT_EQ(Counts().uncached, 10);
  EXPECT_EQ(Counts().launches, kKeys + 2 * (kKeys - 10));
}

// A step's NS phases, a graph per group, replayed in group order: as many
// groups as a model with a group per layer and a half has (more than the
// cache once held) capture once and then only replay.
TEST_F(CudaRunGraphTest, AGraphPerLayerGroupCapturesOnceOverSteps) {
  constexpr int kGroups = 200;
  ASSERT_NO_FATAL_FAILURE(CycleKeys(3, kGroups, 1000));
  EXPECT_EQ(Counts().captures, kGroups);
  EXPECT_EQ(Counts().launches, 3 * kGroups);
}

TEST_F(CudaRunGraphTest, UncapturableWorkRunsDirectlyAndIsNotRetried) {
  int runs = 0;
  auto work = [&]() -> absl::Status {
    ++runs;
    if (absl::Status s = gpu_->Copy2D(dst_, src_); !s.ok()) return s;
    return gpu_->Synchronize();  // a host sync: not capturable
  };
  for (int i = 0; i < 2; ++i) {
    Fill(float(i + 7));
    ASSERT_TRUE(gpu_->RunGraph(99, work).ok());
    EXPECT_EQ(Dst(), std::vector<float>(kN, float(i + 7)));
  }
  // Call 1: once captured (failed), once directly; call 2: directly only.
  EXPECT_EQ(runs, 3);
  EXPECT_EQ(Counts().fallbacks, 1);
  EXPECT_EQ(Counts().captures, 0);
  // The backend works as before after the failed capture.
  Fill(4.0f);
  ASSERT_TRUE(Convert(100).ok());
  EXPECT_EQ(Dst(), std::vector<float>(kN, 4.0f));
  EXPECT_EQ(Counts().captures, 1);
}

TEST_F(CudaRunGraphTest, NestedRunGraphIsPartOfTheOuterGraph) {
  auto outer = [&] { return Convert(7); };
  Fill(2.0f);
  ASSERT_TRUE(gpu_->RunGraph(8, outer).ok());
  EXPECT_EQ(Dst(), std::vector<float>(kN, 2.0f));
  EXPECT_EQ(Counts().captures, 1);  // key 8 only
  Fill(6.0f);
  ASSERT_TRUE(gpu_->RunGraph(8, outer).ok());
  EXPECT_EQ(Dst(), std::vector<float>(kN, 6.0f));
  EXPECT_EQ(Counts().captures, 1);
  EXPECT_EQ(Counts().launches, 2);
}

class CudaGraphsOffTest : public CudaRunGraphTest {
 protected:
  CudaGraphsOffTest() { options_.cuda_graphs = false; }
};

TEST_F(CudaGraphsOffTest, RunGraphRunsTheWorkDirectlyEveryTime) {
  for (float value : {3.0f, -1.0f}) {
    Fill(value);
    ASSERT_TRUE(Convert(1).ok());
    EXPECT_EQ(Dst(), std::vector<float>(kN, value));
  }
  EXPECT_EQ(Counts().captures, 0);
  EXPECT_EQ(Counts().launches, 0);
  EXPECT_EQ(Counts().fallbacks, 0);
}

}  // namespace
}  // namespace muond
