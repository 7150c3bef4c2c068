// The sm_90a symmetric GEMM's host side: which arguments it takes, and the
// launch of the schedule Args names (the kernels: sym_gemm_sm90_kernel.cuh,
// instantiated in sym_gemm_sm90_cooperative.cu, sym_gemm_sm90_pingpong.cu and
// sym_gemm_sm90_wide.cu, compiled apart so that their long CUTLASS builds run
// in parallel).
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "core/backend/sym_gemm_sm90.h"
#include "core/backend/sym_gemm_sm90_launch.h"
#include "core/backend/sym_gemm_tiles.h"

namespace muond {
namespace sym_gemm_sm90 {
namespace {

int SmCount(int device) {
  static std::mutex mu;
  static int counts[64] = {};
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0) {
    cudaDeviceGetAttribute(&counts[device], cudaDevAttrMultiProcessorCount,
                           device);
  }
  return counts[device];
}

bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool Mult8(int64_t v) { return v % 8 == 0; }

}  // namespace

bool DeviceSupported(int device) {
  static std::mutex mu;
  static int state[64] = {};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= 64) return false;
  std::lock_guard<std::mutex> lock(mu);
  if (state[device] == 0) {
    int major = 0, minor = 0;
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                               device) == cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                               device) == cudaSuccess;
    state[device] = ok && major == 9 && minor == 0 ? 1 : 2;
  }
  return state[device] == 1;
}

const char* Unsupported(const Args& a) {
  if (a.trans_a && a.trans_b) return "op pair must be (N,T), (T,N) or (N,N)";
  if (a.n < 1 || a.k < 1 || a.batch < 1) return "n, k and batch must be >= 1";
  if (a.n > (int64_t(1) << 21) || a.k > (int64_t(1) << 30)) {
    return "n must be <= 2^21 and k <= 2^30";  // tiles < 2^14 (TileOfIndex)
  }
  // CUTLASS's TMA rule (CollectiveMma::can_implement): the contiguous extent
  // of each operand (op(a): k if N, n if T; op(b): n if N, k if T) a multiple
  // of 8 elements. The one mismatch of the H200 check (bf16, (T,N), n = 130,
  // k = 455) broke it; every case that kept it matched cuBLAS.
  if ((a.trans_a ? a.n : a.k) % 8 != 0 || (a.trans_b ? a.k : a.n) % 8 != 0) {
    return "the operands' contiguous extents (n or k) must be multiples of 8";
  }
  const int64_t tiles = (a.n + kSymTile - 1) / kSymTile;
  if (LowerTileWork(tiles, a.batch) >= (int64_t(1) << 31)) {
    return "batch x lower tiles must be < 2^31";
  }
  if (!Aligned(a.a) || !Aligned(a.b) || !Aligned(a.d) ||
      (a.beta != 0.0f && !Aligned(a.c))) {
    return "pointers must be 16-byte aligned";
  }
  if (!Mult8(a.lda) || !Mult8(a.ldb) || !Mult8(a.ldd) ||
      (a.beta != 0.0f && !Mult8(a.ldc))) {
    return "leading dimensions must be multiples of 8 elements";
  }
  if (a.batch > 1 &&
      (a.stride_a <= 0 || a.stride_b <= 0 || a.stride_d <= 0 ||
       !Mult8(a.stride_a) || !Mult8(a.stride_b) || !Mult8(a.stride_d))) {
    return "batch strides must be positive multiples of 8 elements";
  }
  // The epilogue reads c's tiles with 16-byte loads (0: one c for all).
  if (a.batch > 1 && a.beta != 0.0f && (a.stride_c < 0 || !Mult8(a.stride_c))) {
    return "c's batch stride must be 0 or a positive multiple of 8 elements";
  }
  return "";
}

cudaError_t Run(const Args& a, cudaStream_t stream) {
  Device dev;
  cudaError_t err = cudaGetDevice(&dev.id);
  if (err != cudaSuccess) return err;
  dev.sm_count = SmCount(dev.id);
  switch (a.schedule) {
    case Schedule::kPingpong:
      return RunPingpong(a, dev, stream);
    case Schedule::kWide:
      return RunWide(a, dev, stream);
    case Schedule::kCooperative:
      break;
  }
  return RunCooperative(a, dev, stream);
}

}  // namespace sym_gemm_sm90
}  // namespace muond
