// CudaBackend's Gram Newton-Schulz helpers: the symmetric product (the
// sm_90a lower-triangle kernel or cuBLASLt's full product + mirror), the
// rule that picks between them, the mirror itself and the diagonal shift.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "core/backend/cuda_backend_impl.h"
#include "core/backend/cuda_gram_kernels.h"
#include "core/backend/cuda_kernels.h"
#include "core/backend/sym_gemm_rule.h"
#include "core/backend/sym_gemm_sm90.h"
#include "core/common/status_macros.h"

namespace muond::cuda_backend_internal {
namespace {

// Measurements behind both rules: bench/results/gpu_h200_sym_gemm.md and
// gpu_h100_sym_gemm_rule.md. When SymmetricGemmStridedBatchedOut runs the
// sm_90a lower-triangle kernel rather than cuBLASLt's full product + mirror:
// the kernel wins for n >= 1536 and for k <= n; below n = 1536 with k in
// 2..3 n it wins batched (1.06-1.31x at batch 8 and more, the MoE layer's
// 768 x 2048 experts 1.2-1.3x; one exception measured, n = 1024 with
// k = 2728 at batch 8, 0.82x) and ties or loses up to 0.82x (~3 us) on
// single products; at k = 3.5 n single products lose up to 0.70x. The rule
// ignores the batch so that a batch of one and a batched call take the same
// path (bitwise equal slices); the step engine batches same-shaped params,
// so it takes the kernel up to k = 3 n.
bool UseSymGemmKernel(int64_t n, int64_t k) { return n >= 1536 || k <= 3 * n; }

// The kernel's schedule for the backend's option; auto: wide tiles for the
// sizes sym_gemm_rule.h says they win at, ping-pong for products with c
// (beta != 0) or of two untransposed operands from n = 2048 (by_size_only)
// and for X X^T and X^T X without c where the batch fills the GPU twice,
// else cooperative (sym_gemm_rule.h).
sym_gemm_sm90::Schedule KernelSchedule(SymGemmSchedule option, int64_t n,
                                       int64_t batch, bool by_size_only,
                                       int64_t sm_count) {
  switch (option) {
    case SymGemmSchedule::kPingpong:
      return sym_gemm_sm90::Schedule::kPingpong;
    case SymGemmSchedule::kWide:
      return sym_gemm_sm90::Schedule::kWide;
    case SymGemmSchedule::kCooperative:
      return sym_gemm_sm90::Schedule::kCooperative;
    case SymGemmSchedule::kAuto:
      break;
  }
  if (sym_gemm_sm90::PrefersWideTiles(n)) return sym_gemm_sm90::Schedule::kWide;
  return sym_gemm_sm90::PrefersPingpong(n, batch, by_size_only, sm_count)
             ? sym_gemm_sm90::Schedule::kPingpong
             : sym_gemm_sm90::Schedule::kCooperative;
}

}  // namespace

absl::Status CudaBackend::AddToDiagonal(const MatrixView& view, int64_t stride,
                                        int64_t batch, float value) {
  RETURN_IF_ERROR(CheckAddToDiagonal(view, batch));
  return CudaStatus(
      cuda_gram_kernels::AddToDiagonal(view.data, int(view.dtype), view.rows,
                                       std::max(view.row_stride, view.cols),
                                       stride, batch, value, stream_),
      "add_to_diagonal");
}

// The sm_90a kernel (lower tiles + mirror) for bf16/fp16 on compute
// capability 9.0 where UseSymGemmKernel; otherwise (fp32, other devices,
// the sizes cuBLAS does better, op pairs or layouts the kernel does not
// take) cuBLASLt's full product and the mirror kernel (Backend's default).
absl::Status CudaBackend::SymmetricGemmStridedBatchedOut(
    Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
    const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
    int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
    MatmulPrecision precision) {
  RETURN_IF_ERROR(CheckGemmOut(op_a, op_b, a, b, c, d, precision));
  RETURN_IF_ERROR(CheckBatch(batch));
  const bool half = d.dtype == DType::kBFloat16 || d.dtype == DType::kFloat16;
  const int64_t k = op_a == Op::kN ? a.cols : a.rows;
  if (half && d.rows == d.cols && UseSymGemmKernel(d.rows, k) &&
      sym_gemm_sm90::DeviceSupported(device_)) {
    sym_gemm_sm90::Args s;
    s.elem = d.dtype == DType::kBFloat16 ? sym_gemm_sm90::Elem::kBFloat16
                                         : sym_gemm_sm90::Elem::kFloat16;
    // The batch may pick the schedule only for X X^T and X^T X without c
    // (sym_gemm_rule.h PrefersPingpong says why).
    const bool by_size_only = beta != 0.0f || op_a == op_b;
    s.schedule = KernelSchedule(options_.sym_gemm_schedule, d.rows, batch,
                                by_size_only, SmCount());
    s.trans_a = op_a == Op::kT;
    s.trans_b = op_b == Op::kT;
    s.n = d.rows;
    s.k = k;
    s.batch = batch;
    s.alpha = alpha;
    s.beta = beta;
    s.a = a.data, s.lda = Ld(a), s.stride_a = stride_a;
    s.b = b.data, s.ldb = Ld(b), s.stride_b = stride_b;
    s.c = c.data, s.ldc = Ld(c), s.stride_c = stride_c;
    s.d = d.data, s.ldd = Ld(d), s.stride_d = stride_d;
    if (*sym_gemm_sm90::Unsupported(s) == '\0') {
      return CudaStatus(sym_gemm_sm90::Run(s, stream_), "symmetric gemm");
    }
  }
  return Backend::SymmetricGemmStridedBatchedOut(op_a, op_b, alpha, a, stride_a,
                                                 b, stride_b, beta, c, stride_c,
                                                 d, stride_d, batch, precision);
}

// Whether the kernel also beats the plain full product (no mirror), i.e.
// whether a caller should prefer the symmetric call: the size and batch
// rule of sym_gemm_rule.h on this device's SM count.
bool CudaBackend::FastSymmetricGemm(int64_t n, int64_t k, DType dtype,
                                    int64_t batch) const {
  // Contiguous operands meet the kernel's layout rules when n and k are
  // multiples of 8 (sym_gemm_sm90::Unsupported).
  return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) &&
         n % 8 == 0 && k % 8 == 0 &&
         sym_gemm_sm90::BeatsFullGemm(n, batch, SmCount()) &&
         sym_gemm_sm90::DeviceSupported(device_);
}

// Multiprocessors of device_, queried once. A failed query counts as a
// GPU no batch can fill, leaving only the single-product size rule.
int64_t CudaBackend::SmCount() const {
  if (sm_count_ == 0 &&
      cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount,
                             device_) != cudaSuccess) {
    sm_count_ = -1;
  }
  return sm_count_ > 0 ? sm_count_ : int64_t{1} << 40;
}

absl::Status CudaBackend::SymmetrizeFromLower(const MatrixView& a,
                                              int64_t stride, int64_t batch) {
  RETURN_IF_ERROR(CheckView(a, "symmetrize"));
  if (a.rows != a.cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        "symmetrize: slices must be square, got ", a.rows, "x", a.cols));
  }
  return CudaStatus(
      cuda_kernels::SymmetrizeFromLower(K(a), stride, batch, stream_),
      "symmetrize");
}

}  // namespace muond::cuda_backend_internal
