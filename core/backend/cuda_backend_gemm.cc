// CudaBackend's dense GEMMs: cuBLASLt with one cached plan (descriptors and
// heuristic algorithm) per problem, the optional lt_autotune timing pass,
// and cublasGemmEx / cublasGemmStridedBatchedEx when Lt offers no algorithm
// or CudaBackendOptions::cublas_gemmex asks for the legacy path.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/backend/cuda_backend_impl.h"
#include "core/common/status_macros.h"

namespace muond::cuda_backend_internal {
namespace {

cudaDataType_t CudaType(DType d) {
  switch (d) {
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

cublasComputeType_t ComputeType(MatmulPrecision p) {
  return p == MatmulPrecision::kHigh ? CUBLAS_COMPUTE_32F_FAST_TF32
                                     : CUBLAS_COMPUTE_32F;
}

cublasOperation_t CuOp(Op op) {
  return op == Op::kN ? CUBLAS_OP_N : CUBLAS_OP_T;
}

// Largest power of two (<= 256) dividing the address: cublasLt's heuristics
// must only offer kernels that the operands' alignment allows.
uint32_t Alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

}  // namespace

absl::Status CudaBackend::Gemm(Op op_a, Op op_b, float alpha,
                               const MatrixView& a, const MatrixView& b,
                               float beta, const MatrixView& c,
                               MatmulPrecision precision) {
  RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, c, precision));
  return Matmul(op_a, op_b, alpha, a, 0, b, 0, beta, c, 0, c, 0, 1, precision);
}

absl::Status CudaBackend::GemmStridedBatched(
    Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
    const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
    int64_t stride_c, int64_t batch, MatmulPrecision precision) {
  RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, c, precision));
  RETURN_IF_ERROR(CheckBatch(batch));
  return Matmul(op_a, op_b, alpha, a, stride_a, b, stride_b, beta, c, stride_c,
                c, stride_c, batch, precision);
}

absl::Status CudaBackend::GemmOut(Op op_a, Op op_b, float alpha,
                                  const MatrixView& a, const MatrixView& b,
                                  float beta, const MatrixView& c,
                                  const MatrixView& d,
                                  MatmulPrecision precision) {
  RETURN_IF_ERROR(CheckGemmOut(op_a, op_b, a, b, c, d, precision));
  return Matmul(op_a, op_b, alpha, a, 0, b, 0, beta, c, 0, d, 0, 1, precision);
}

absl::Status CudaBackend::GemmStridedBatchedOut(
    Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
    const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
    int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
    MatmulPrecision precision) {
  RETURN_IF_ERROR(CheckGemmOut(op_a, op_b, a, b, c, d, precision));
  RETURN_IF_ERROR(CheckBatch(batch));
  return Matmul(op_a, op_b, alpha, a, stride_a, b, stride_b, beta, c, stride_c,
                d, stride_d, batch, precision);
}

absl::Status CudaBackend::CheckGemmOut(Op op_a, Op op_b, const MatrixView& a,
                                       const MatrixView& b, const MatrixView& c,
                                       const MatrixView& d,
                                       MatmulPrecision precision) {
  RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, d, precision));
  RETURN_IF_ERROR(CheckSameShape(d, c, "gemm d", "gemm c"));
  return CheckDType(c, d.dtype, "gemm c");
}

absl::Status CudaBackend::CheckBatch(int64_t batch) {
  if (batch < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm: batch must be >= 0, got ", batch));
  }
  return absl::OkStatus();
}

// d = alpha op(a) op(b) + beta c over `batch` slices (arguments checked).
// Row-major D = op(A) op(B) is column-major D^T = op(B)^T op(A)^T, so the
// column-major call takes b as its first operand. cublasLt with its own
// heuristic pick per problem; cublasGemmEx (after a copy when d != c) when
// Lt offers no algorithm or CudaBackendOptions::cublas_gemmex.
absl::Status CudaBackend::Matmul(Op op_a, Op op_b, float alpha,
                                 const MatrixView& a, int64_t sa,
                                 const MatrixView& b, int64_t sb, float beta,
                                 const MatrixView& c, int64_t sc,
                                 const MatrixView& d, int64_t sd, int64_t batch,
                                 MatmulPrecision precision) {
  if (handle_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        name_, ": a stream without cuBLAS (Backend::NewStream) runs no GEMM"));
  }
  const int64_t m = d.rows, n = d.cols, k = op_a == Op::kN ? a.cols : a.rows;
  if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
  // beta == 0 never reads C: point it at D (NaN in c never leaks).
  const MatrixView& cc = beta == 0.0f ? d : c;
  const int64_t scc = beta == 0.0f ? sd : sc;
  if (use_lt_) {
    const std::array<int64_t, 20> key = {
        int64_t(op_a),
        int64_t(op_b),
        m,
        n,
        k,
        Ld(a),
        Ld(b),
        Ld(cc),
        Ld(d),
        int64_t(a.dtype),
        int64_t(d.dtype),
        int64_t(precision),
        batch,
        batch > 1 ? sa : 0,
        batch > 1 ? sb : 0,
        batch > 1 ? scc : 0,
        batch > 1 ? sd : 0,
        int64_t(Alignment(a.data)) * 1024 + Alignment(b.data),
        int64_t(Alignment(cc.data)) * 1024 + Alignment(d.data),
        cc.data == d.data ? 1 : 0};
    auto it = lt_plans_.find(key);
    if (it == lt_plans_.end()) {
      it = lt_plans_.emplace(key, LtPlan{}).first;
      RETURN_IF_ERROR(BuildPlan(op_a, op_b, m, n, k, a, sa, b, sb, cc, scc, d,
                                sd, batch, precision, &it->second));
      if (it->second.ok && autotune_ > 1 && cc.data != d.data &&
          d.data != a.data && d.data != b.data) {
        RETURN_IF_ERROR(Autotune(alpha, beta, a, b, cc, d, &it->second));
      }
    }
    const LtPlan& p = it->second;
    if (p.ok) {
      return CublasStatus(
          cublasLtMatmul(lt_, p.desc, &alpha, b.data, p.a, a.data, p.b, &beta,
                         cc.data, p.c, d.data, p.d, &p.algo, cublas_workspace_,
                         kCublasWorkspaceBytes, stream_),
          "gemm (cublasLt)");
    }
  }
  if (beta != 0.0f && c.data != d.data) {
    const int64_t es = int64_t(DTypeSize(c.dtype));
    for (int64_t i = 0; i < batch; ++i) {
      MatrixView ci = c, di = d;
      ci.data = static_cast<char*>(c.data) + i * sc * es;
      di.data = static_cast<char*>(d.data) + i * sd * es;
      RETURN_IF_ERROR(Copy2D(di, ci));
    }
  }
  if (batch == 1) {
    return CublasStatus(
        cublasGemmEx(handle_, CuOp(op_b), CuOp(op_a), int(n), int(m), int(k),
                     &alpha, b.data, CudaType(b.dtype), int(Ld(b)), a.data,
                     CudaType(a.dtype), int(Ld(a)), &beta, d.data,
                     CudaType(d.dtype), int(Ld(d)), ComputeType(precision),
                     CUBLAS_GEMM_DEFAULT),
        "gemm");
  }
  return CublasStatus(
      cublasGemmStridedBatchedEx(
          handle_, CuOp(op_b), CuOp(op_a), int(n), int(m), int(k), &alpha,
          b.data, CudaType(b.dtype), int(Ld(b)), sb, a.data, CudaType(a.dtype),
          int(Ld(a)), sa, &beta, d.data, CudaType(d.dtype), int(Ld(d)), sd,
          int(batch), ComputeType(precision), CUBLAS_GEMM_DEFAULT),
      "gemm strided batched");
}

absl::Status CudaBackend::Layout(cudaDataType_t type, int64_t rows,
                                 int64_t cols, int64_t ld, int64_t batch,
                                 int64_t stride, cublasLtMatrixLayout_t* out) {
  RETURN_IF_ERROR(CublasStatus(
      cublasLtMatrixLayoutCreate(out, type, uint64_t(rows), uint64_t(cols), ld),
      "cublasLtMatrixLayoutCreate"));
  if (batch > 1) {
    const int32_t count = int32_t(batch);
    RETURN_IF_ERROR(CublasStatus(
        cublasLtMatrixLayoutSetAttribute(
            *out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
        "cublasLt batch count"));
    RETURN_IF_ERROR(
        CublasStatus(cublasLtMatrixLayoutSetAttribute(
                         *out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                         &stride, sizeof(stride)),
                     "cublasLt batch stride"));
  }
  return absl::OkStatus();
}

// Column-major problem: D^T (n x m) = op(B)^T (n x k) op(A)^T (k x m).
absl::Status CudaBackend::BuildPlan(Op op_a, Op op_b, int64_t m, int64_t n,
                                    int64_t /*k*/, const MatrixView& a,
                                    int64_t sa, const MatrixView& b, int64_t sb,
                                    const MatrixView& c, int64_t sc,
                                    const MatrixView& d, int64_t sd,
                                    int64_t batch, MatmulPrecision precision,
                                    LtPlan* plan) {
  RETURN_IF_ERROR(CublasStatus(
      cublasLtMatmulDescCreate(&plan->desc, ComputeType(precision), CUDA_R_32F),
      "cublasLtMatmulDescCreate"));
  const cublasOperation_t ta = CuOp(op_b), tb = CuOp(op_a);
  RETURN_IF_ERROR(CublasStatus(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                     &ta, sizeof(ta)),
      "cublasLt transa"));
  RETURN_IF_ERROR(CublasStatus(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                     &tb, sizeof(tb)),
      "cublasLt transb"));
  // Stored (column-major) shapes: b is rows=b.cols x cols=b.rows, etc.
  RETURN_IF_ERROR(
      Layout(CudaType(b.dtype), b.cols, b.rows, Ld(b), batch, sb, &plan->a));
  RETURN_IF_ERROR(
      Layout(CudaType(a.dtype), a.cols, a.rows, Ld(a), batch, sa, &plan->b));
  RETURN_IF_ERROR(Layout(CudaType(c.dtype), n, m, Ld(c), batch, sc, &plan->c));
  RETURN_IF_ERROR(Layout(CudaType(d.dtype), n, m, Ld(d), batch, sd, &plan->d));
  cublasLtMatmulPreference_t pref = nullptr;
  RETURN_IF_ERROR(CublasStatus(cublasLtMatmulPreferenceCreate(&pref),
                               "cublasLtMatmulPreferenceCreate"));
  const uint64_t ws = kCublasWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const uint32_t al_a = Alignment(b.data), al_b = Alignment(a.data),
                 al_c = Alignment(c.data), al_d = Alignment(d.data);
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt_, plan->desc, plan->a, plan->b, plan->c,
                                     plan->d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 &&
      result.state == CUBLAS_STATUS_SUCCESS) {
    plan->algo = result.algo;
    plan->ok = true;
    plan->pref_alignment = {al_a, al_b, al_c, al_d};
  }
  return absl::OkStatus();
}

// lt_autotune N (diagnostic, off by default: the pick would depend
// on timings): times the heuristic's first N algorithms once (D is
// separate from A, B, C, so re-running is harmless) and keeps the fastest.
absl::Status CudaBackend::Autotune(float alpha, float beta, const MatrixView& a,
                                   const MatrixView& b, const MatrixView& c,
                                   const MatrixView& d, LtPlan* plan) {
  cublasLtMatmulPreference_t pref = nullptr;
  RETURN_IF_ERROR(CublasStatus(cublasLtMatmulPreferenceCreate(&pref),
                               "cublasLtMatmulPreferenceCreate"));
  const uint64_t ws = kCublasWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const cublasLtMatmulPreferenceAttributes_t attrs[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    cublasLtMatmulPreferenceSetAttribute(
        pref, attrs[i], &plan->pref_alignment[i], sizeof(uint32_t));
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(autotune_);
  int found = 0;
  cublasLtMatmulAlgoGetHeuristic(lt_, plan->desc, plan->a, plan->b, plan->c,
                                 plan->d, pref, autotune_, results.data(),
                                 &found);
  cublasLtMatmulPreferenceDestroy(pref);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = -1.0f;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    float total = 0.0f;
    bool ok = true;
    for (int rep = 0; rep < 4 && ok; ++rep) {
      cudaEventRecord(e0, stream_);
      ok = cublasLtMatmul(lt_, plan->desc, &alpha, b.data, plan->a, a.data,
                          plan->b, &beta, c.data, plan->c, d.data, plan->d,
                          &results[i].algo, cublas_workspace_,
                          kCublasWorkspaceBytes,
                          stream_) == CUBLAS_STATUS_SUCCESS;
      cudaEventRecord(e1, stream_);
      cudaEventSynchronize(e1);
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, e0, e1);
      if (rep > 0) total += ms;  // first run is a warm-up
    }
    if (ok && (best < 0.0f || total < best)) {
      best = total;
      plan->algo = results[i].algo;
    }
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return CudaStatus(cudaGetLastError(), "gemm autotune");
}

}  // namespace muond::cuda_backend_internal
