#pragma once
// The fixture of the C++ GPU tests: skips without a CUDA device, gives a CUDA
// backend (gpu_) and the CPU backend (cpu_, the usual reference), and frees
// what the test allocated on the device at TearDown.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/backend/backend.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "tests/common/cuda_device.h"

namespace muond::testing {

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveCudaDevice()) GTEST_SKIP() << "no CUDA device on this machine";
    auto b = MakeCudaBackend(0);
    ASSERT_TRUE(b.ok()) << b.status();
    gpu_ = std::move(*b);
    cpu_ = MakeCpuBackend();
  }
  void TearDown() override {
    for (void* p : allocs_) gpu_->Free(p);
  }
  // Device bytes, freed at TearDown.
  void* Dev(int64_t bytes) {
    void* p = *gpu_->Allocate(bytes);
    allocs_.push_back(p);
    return p;
  }
  // A device copy of `bytes` host bytes.
  void* Up(const void* host, int64_t bytes) {
    void* p = Dev(bytes);
    EXPECT_TRUE(gpu_->CopyFromHost(p, host, bytes).ok());
    return p;
  }
  // The first n elements of type T at dev.
  template <typename T>
  std::vector<T> Down(const void* dev, int64_t n) {
    std::vector<T> out(n);
    EXPECT_TRUE(gpu_->CopyToHost(out.data(), dev, n * sizeof(T)).ok());
    return out;
  }

  std::unique_ptr<Backend> gpu_, cpu_;
  std::vector<void*> allocs_;
};

}  // namespace muond::testing
