// Hopper (sm_90a) symmetric GEMM: d = alpha op(a) op(b) + beta c for products
// the caller knows are symmetric, computing only the lower-triangle tiles and
// writing each off-diagonal tile twice (itself and its mirror). The CUDA
// backend's SymmetricGemmStridedBatchedOut is its caller (and the standalone
// check, bench/gpu/sym_gemm_sm90_check.cu); CUTLASS stays inside the
// sym_gemm_sm90*.cu files (kernel: sym_gemm_sm90_kernel.cuh).
//
// Matrices are row-major views (muond's convention): element (r, c) of a
// matrix is at data[r * ld + c], slice i of a batch at data + i * stride.
#ifndef MUOND_CORE_BACKEND_SYM_GEMM_SM90_H_
#define MUOND_CORE_BACKEND_SYM_GEMM_SM90_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace muond {
namespace sym_gemm_sm90 {

enum class Elem { kBFloat16, kFloat16 };

// How the kernel's two consumer warpgroups share the work
// (sym_gemm_sm90_kernel.cuh): both on one 128 x 128 tile, its epilogue after
// its mainloop (cooperative); a tile each, alternating, one's epilogue under
// the other's mainloop (ping-pong); or both on one 128 x 256 tile (wide).
enum class Schedule { kCooperative, kPingpong, kWide };

struct Args {
  Elem elem = Elem::kBFloat16;
  Schedule schedule = Schedule::kCooperative;
  // op(a) is n x k, op(b) is k x n (row-major ops as in Backend::Gemm).
  bool trans_a = false;
  bool trans_b = true;
  int64_t n = 0;
  int64_t k = 0;
  int64_t batch = 1;
  float alpha = 1.0f;
  float beta = 0.0f;  // 0: c is not read (may be null)
  const void* a = nullptr;
  int64_t lda = 0, stride_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, stride_b = 0;
  // Symmetric: only its lower triangle affects d (diagonal tiles read the
  // whole tile and discard the upper half). Must not overlap d: the kernel
  // reads c while it writes d (the cooperative schedule reads a CTA's next
  // tile of c, by cp.async, before the CTA's current tile is written).
  const void* c = nullptr;
  int64_t ldc = 0, stride_c = 0;
  void* d = nullptr;
  int64_t ldd = 0, stride_d = 0;
};

// True when `device` is compute capability 9.0 (checked once per device)
// and this build carries the sm_90a kernel.
bool DeviceSupported(int device);

// Why the kernel cannot run these arguments ("" when it can): the op pair
// (N,T), (T,N) (X X^T, X^T X) or (N,N) (products of commuting symmetric
// matrices), 16-byte aligned pointers, leading dimensions and batch strides
// that are multiples of 8 elements (c's, when beta != 0 and batch > 1: 0 or
// a positive multiple of 8), each operand's contiguous extent (n or k) a
// multiple of 8, n, k >= 1, batch >= 1.
const char* Unsupported(const Args& args);

// Launches the kernel on `stream` (asynchronous). Precondition:
// DeviceSupported(current device) and Unsupported(args) == "".
cudaError_t Run(const Args& args, cudaStream_t stream);

}  // namespace sym_gemm_sm90
}  // namespace muond

#endif  // MUOND_CORE_BACKEND_SYM_GEMM_SM90_H_
