// The Gram Newton–Schulz numerics suite (gram_spectra_suite.h) on the CUDA
// backend (tag gpu; skipped without a device): the CPU test's shapes plus
// 1024 x 4096 and 4096 x 1024, where the tiled and symmetric GEMM kernels
// run at full size. Each check prints its measured numbers.
#include <gtest/gtest.h>

#include "core/backend/cuda_backend.h"
#include "tests/common/cuda_test.h"
#include "tests/core/muon/gram_spectra_suite.h"

namespace muond::testing {
namespace {

class GramSpectraCudaTest : public CudaTest {};

TEST_F(GramSpectraCudaTest, ErrorsFiniteScaleInvariantAndZero) {
  CheckSpectraErrors(
      gpu_.get(),
      {{64, 256}, {256, 64}, {96, 160}, {1024, 4096}, {4096, 1024}});
}

TEST_F(GramSpectraCudaTest, SigmaMaxBoundHoldsOnlyWithRestarts) {
  CheckSigmaMaxBound(gpu_.get(),
                     {{64, 256, true}, {256, 64, true}, {1024, 4096, false}});
}

TEST_F(GramSpectraCudaTest, SigmaMaxBoundHoldsAtShapeClasses) {
  CheckSigmaMaxAtShapeClasses(
      gpu_.get(), {{8, 24}, {24, 8}, {12, 30}, {30, 12}, {16, 64}, {32, 128},
                   {128, 32}, {64, 256}, {128, 512}, {256, 640}, {640, 256},
                   {512, 1536}});
}

}  // namespace
}  // namespace muond::testing
