#include "core/backend/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "core/backend/cuda_kernels.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t(64) << 20;

absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(std::string(what), ": CUDA error ",
                                          cudaGetErrorString(err)));
}

absl::Status CublasStatus(cublasStatus_t st, std::string_view what) {
  if (st == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(std::string(what), ": cuBLAS error ",
                                          cublasGetStatusString(st)));
}

int64_t Ld(const MatrixView& v) {
  return std::max<int64_t>({v.row_stride, v.cols, 1});
}

cudaDataType_t CudaType(DType d) {
  return d == DType::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
}

cublasComputeType_t ComputeType(MatmulPrecision p) {
  return p == MatmulPrecision::kHigh ? CUBLAS_COMPUTE_32F_FAST_TF32
                                     : CUBLAS_COMPUTE_32F;
}

cuda_kernels::KView K(const MatrixView& v) {
  return cuda_kernels::KView{v.data, v.rows, v.cols, Ld(v),
                             static_cast<int>(DTypeSize(v.dtype))};
}

cublasOperation_t CuOp(Op op) {
  return op == Op::kN ? CUBLAS_OP_N : CUBLAS_OP_T;
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device)
      : device_(device), name_(absl::StrCat("cuda:", device)) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (handle_ != nullptr) cublasDestroy(handle_);
    cudaFree(cublas_workspace_);
    cudaFree(partials_);
    cudaFree(flag_);
    cudaFreeHost(host_flag_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                   "cudaStreamCreate"));
    RETURN_IF_ERROR(CublasStatus(cublasCreate(&handle_), "cublasCreate"));
    RETURN_IF_ERROR(
        CublasStatus(cublasSetStream(handle_, stream_), "cublasSetStream"));
    RETURN_IF_ERROR(CublasStatus(
        cublasSetMathMode(handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
    RETURN_IF_ERROR(CudaStatus(
        cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes), "cudaMalloc"));
    RETURN_IF_ERROR(CublasStatus(
        cublasSetWorkspace(handle_, cublas_workspace_, kCublasWorkspaceBytes),
        "cublasSetWorkspace"));
    RETURN_IF_ERROR(CudaStatus(
        cudaMalloc(&partials_, sizeof(double) * cuda_kernels::kNormBlocks *
                                   cuda_kernels::kNormBatchChunk),
        "cudaMalloc"));
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&flag_, sizeof(int)), "cudaMalloc"));
    RETURN_IF_ERROR(
        CudaStatus(cudaMallocHost(&host_flag_, sizeof(int)), "cudaMallocHost"));
    return absl::OkStatus();
  }

  void* stream() const override { return stream_; }

  std::string_view name() const override { return name_; }
  bool is_device() const override { return true; }
  bool SupportsPrecision(MatmulPrecision) const override { return true; }

  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("allocate: bytes must be >= 0, got ", bytes));
    }
    void* p = nullptr;
    cudaSetDevice(device_);
    const cudaError_t err = cudaMalloc(&p, bytes == 0 ? 256 : size_t(bytes));
    if (err != cudaSuccess) {
      return absl::ResourceExhaustedError(
          absl::StrCat("allocate: cudaMalloc of ", bytes, " bytes on ", name_,
                       " failed: ", cudaGetErrorString(err)));
    }
    return p;
  }
  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    cudaStreamSynchronize(stream_);
    cudaFree(ptr);
  }

  absl::Status Memset0(const MatrixView& v) override {
    RETURN_IF_ERROR(CheckView(v, "memset0"));
    if (v.numel() == 0) return absl::OkStatus();
    const size_t es = DTypeSize(v.dtype);
    return CudaStatus(
        cudaMemset2DAsync(v.data, size_t(Ld(v)) * es, 0, size_t(v.cols) * es,
                          size_t(v.rows), stream_),
        "memset0");
  }
  absl::Status CopyFromHost(void* dst, const void* src,
                            int64_t bytes) override {
    if (bytes <= 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(dst, src, size_t(bytes),
                                      cudaMemcpyHostToDevice, stream_),
                      "copy from host");
  }
  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes) override {
    if (bytes <= 0) return absl::OkStatus();
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, src, size_t(bytes),
                                               cudaMemcpyDeviceToHost, stream_),
                               "copy to host"));
    return CudaStatus(cudaStreamSynchronize(stream_), "copy to host sync");
  }
  absl::Status Copy2D(const MatrixView& dst, const MatrixView& src) override {
    RETURN_IF_ERROR(CheckSameShape(dst, src, "copy dst", "copy src"));
    if (src.numel() == 0) return absl::OkStatus();
    if (dst.dtype == src.dtype) {
      if (dst.data == src.data && Ld(dst) == Ld(src)) return absl::OkStatus();
      const size_t es = DTypeSize(src.dtype);
      return CudaStatus(
          cudaMemcpy2DAsync(dst.data, size_t(Ld(dst)) * es, src.data,
                            size_t(Ld(src)) * es, size_t(src.cols) * es,
                            size_t(src.rows), cudaMemcpyDeviceToDevice,
                            stream_),
          "copy2d");
    }
    return CudaStatus(cuda_kernels::Copy2DConvert(K(dst), K(src), stream_),
                      "copy2d convert");
  }

  absl::Status Gemm(Op op_a, Op op_b, float alpha, const MatrixView& a,
                    const MatrixView& b, float beta, const MatrixView& c,
                    MatmulPrecision precision) override {
    RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, c, precision));
    const int64_t m = c.rows, n = c.cols, k = op_a == Op::kN ? a.cols : a.rows;
    if (m == 0 || n == 0) return absl::OkStatus();
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
    return CublasStatus(
        cublasGemmEx(handle_, CuOp(op_b), CuOp(op_a), int(n), int(m), int(k),
                     &alpha, b.data, CudaType(b.dtype), int(Ld(b)), a.data,
                     CudaType(a.dtype), int(Ld(a)), &beta, c.data,
                     CudaType(c.dtype), int(Ld(c)), ComputeType(precision),
                     CUBLAS_GEMM_DEFAULT),
        "gemm");
  }

  absl::Status GemmStridedBatched(Op op_a, Op op_b, float alpha,
                                  const MatrixView& a, int64_t stride_a,
                                  const MatrixView& b, int64_t stride_b,
                                  float beta, const MatrixView& c,
                                  int64_t stride_c, int64_t batch,
                                  MatmulPrecision precision) override {
    RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, c, precision));
    if (batch < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemm: batch must be >= 0, got ", batch));
    }
    const int64_t m = c.rows, n = c.cols, k = op_a == Op::kN ? a.cols : a.rows;
    if (m == 0 || n == 0 || batch == 0) return absl::OkStatus();
    return CublasStatus(
        cublasGemmStridedBatchedEx(
            handle_, CuOp(op_b), CuOp(op_a), int(n), int(m), int(k), &alpha,
            b.data, CudaType(b.dtype), int(Ld(b)), stride_b, a.data,
            CudaType(a.dtype), int(Ld(a)), stride_a, &beta, c.data,
            CudaType(c.dtype), int(Ld(c)), stride_c, int(batch),
            ComputeType(precision), CUBLAS_GEMM_DEFAULT),
        "gemm strided batched");
  }

  absl::Status SymmetrizeFromLower(const MatrixView& a, int64_t stride,
                                   int64_t batch) override {
    RETURN_IF_ERROR(CheckView(a, "symmetrize"));
    if (a.rows != a.cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          "symmetrize: slices must be square, got ", a.rows, "x", a.cols));
    }
    return CudaStatus(
        cuda_kernels::SymmetrizeFromLower(K(a), stride, batch, stream_),
        "symmetrize");
  }

  absl::Status FrobeniusNormalize(const MatrixView& src, const MatrixView& dst,
                                  int64_t batch, float eps) override {
    RETURN_IF_ERROR(CheckNormalize(src, dst, batch, eps));
    const int64_t r = src.rows / batch;
    for (int64_t s0 = 0; s0 < batch; s0 += cuda_kernels::kNormBatchChunk) {
      const int64_t nb = std::min(cuda_kernels::kNormBatchChunk, batch - s0);
      RETURN_IF_ERROR(CudaStatus(cuda_kernels::FrobeniusNormalize(
                                     K(src.Block(s0 * r, 0, nb * r, src.cols)),
                                     K(dst.Block(s0 * r, 0, nb * r, dst.cols)),
                                     nb, eps, partials_, stream_),
                                 "frobenius normalize"));
    }
    return absl::OkStatus();
  }

  absl::Status MuonMomentum(const MatrixView& grad, const MatrixView& momentum,
                            double beta, bool nesterov,
                            const MatrixView& out) override {
    RETURN_IF_ERROR(CheckMomentum(grad, momentum, out));
    return CudaStatus(
        cuda_kernels::MuonMomentum(K(grad), K(momentum), float(1.0 - beta),
                                   float(beta), nesterov, K(out), stream_),
        "muon momentum");
  }

  absl::Status ScaleInPlace(const MatrixView& x, float scale,
                            float extra) override {
    RETURN_IF_ERROR(CheckView(x, "scale"));
    RETURN_IF_ERROR(CheckDType(x, DType::kFloat32, "scale"));
    return CudaStatus(cuda_kernels::ScaleInPlace(K(x), scale, extra, stream_),
                      "scale");
  }

  absl::Status ApplyUpdate(const MatrixView& param, const MatrixView& update,
                           float lr, float decay,
                           WeightDecayMethod method) override {
    RETURN_IF_ERROR(CheckUpdate(param, update));
    return CudaStatus(cuda_kernels::ApplyUpdate(K(param), K(update), lr, decay,
                                                int(method), stream_),
                      "apply update");
  }

  absl::Status AdamW(const MatrixView& param, const MatrixView& grad,
                     const MatrixView& exp_avg, const MatrixView& exp_avg_sq,
                     const AdamWScalars& s) override {
    RETURN_IF_ERROR(CheckAdamW(param, grad, exp_avg, exp_avg_sq));
    return CudaStatus(
        cuda_kernels::AdamW(K(param), K(grad), K(exp_avg), K(exp_avg_sq),
                            s.param_decay, s.one_minus_beta1, s.beta2,
                            s.one_minus_beta2, s.step_size,
                            s.bias_correction2_sqrt, s.eps, stream_),
        "adamw");
  }

  absl::StatusOr<bool> AllFinite(absl::Span<const MatrixView> views) override {
    for (const MatrixView& v : views)
      RETURN_IF_ERROR(CheckView(v, "all_finite"));
    RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(flag_, 0, sizeof(int), stream_),
                               "all_finite"));
    for (const MatrixView& v : views) {
      RETURN_IF_ERROR(CudaStatus(
          cuda_kernels::MarkNonFinite(K(v), flag_, stream_), "all_finite"));
    }
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host_flag_, flag_, sizeof(int),
                                               cudaMemcpyDeviceToHost, stream_),
                               "all_finite"));
    RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream_), "all_finite sync"));
    return *host_flag_ == 0;
  }

  absl::Status Synchronize() override {
    return CudaStatus(cudaStreamSynchronize(stream_), "synchronize");
  }

 private:
  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  void* cublas_workspace_ = nullptr;
  double* partials_ = nullptr;
  int* flag_ = nullptr;
  int* host_flag_ = nullptr;
};

}  // namespace

bool CudaDeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        "MakeCudaBackend: no CUDA device is visible on this machine");
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MakeCudaBackend: device must be in [0, ", count, "), got ", device));
  }
  auto backend = std::make_unique<CudaBackend>(device);
  RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace muond
