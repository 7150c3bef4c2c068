#include "core/backend/cuda_backend.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExt.h>

#include <array>
#include <cstdlib>
#include <list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/backend/cuda_gram_kernels.h"
#include "core/backend/cuda_kernels.h"
#include "core/backend/sym_gemm_rule.h"
#include "core/backend/sym_gemm_sm90.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t(64) << 20;

// H200 measurements behind both rules: bench/results/gpu_h200_sym_gemm.md.
// When SymmetricGemmStridedBatchedOut runs the sm_90a lower-triangle kernel
// rather than cuBLASLt's full product + mirror: the kernel wins 1.06-1.74x
// for n >= 1536, for k <= n and for batches >= 8, and ties or loses
// (0.70-1.01x) only for single products with n in 512..1024 and k = 3.5 n.
// The rule ignores the batch so that a batch of one and a batched call take
// the same path (bitwise equal slices).
bool UseSymGemmKernel(int64_t n, int64_t k) { return n >= 1536 || k <= 2 * n; }

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

cuda_kernels::KView K(const MatrixView& v) {
  cuda_kernels::KView k{v.data, v.rows, v.cols, Ld(v),
                        static_cast<int>(DTypeSize(v.dtype))};
  k.f16 = v.dtype == DType::kFloat16;
  return k;
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

// One cublasLt problem: descriptors and the chosen algorithm, built once per
// distinct (shape, layout, dtype, batch, alignment) and reused.
struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;  // false: no algorithm (use cublasGemmEx instead)
  std::array<uint32_t, 4> pref_alignment{};
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options)
      : device_(device),
        options_(options),
        name_(absl::StrCat("cuda:", device)) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (auto& [key, exec] : graph_lru_) cudaGraphExecDestroy(exec);
    for (auto& [key, plan] : lt_plans_) {
      for (cublasLtMatrixLayout_t l : {plan.a, plan.b, plan.c, plan.d})
        if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
      if (plan.desc != nullptr) cublasLtMatmulDescDestroy(plan.desc);
    }
    if (lt_ != nullptr) cublasLtDestroy(lt_);
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
    RETURN_IF_ERROR(CublasStatus(cublasLtCreate(&lt_), "cublasLtCreate"));
    // cublas_gemmex: the legacy cublasGemmEx path (plus a copy for a
    // separate output), for A/B measurements.
    use_lt_ = !options_.cublas_gemmex;
    // No cuda_graphs: RunGraph runs its work directly (debugging).
    graphs_on_ = options_.cuda_graphs;
    autotune_ = std::max(0, std::min(kMaxLtAutotune, options_.lt_autotune));
    RETURN_IF_ERROR(CudaStatus(
        cudaMalloc(&partials_, sizeof(double) * cuda_kernels::kNormPartials),
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
    return Matmul(op_a, op_b, alpha, a, 0, b, 0, beta, c, 0, c, 0, 1,
                  precision);
  }

  absl::Status GemmStridedBatched(Op op_a, Op op_b, float alpha,
                                  const MatrixView& a, int64_t stride_a,
                                  const MatrixView& b, int64_t stride_b,
                                  float beta, const MatrixView& c,
                                  int64_t stride_c, int64_t batch,
                                  MatmulPrecision precision) override {
    RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, c, precision));
    RETURN_IF_ERROR(CheckBatch(batch));
    return Matmul(op_a, op_b, alpha, a, stride_a, b, stride_b, beta, c,
                  stride_c, c, stride_c, batch, precision);
  }

  absl::Status GemmOut(Op op_a, Op op_b, float alpha, const MatrixView& a,
                       const MatrixView& b, float beta, const MatrixView& c,
                       const MatrixView& d,
                       MatmulPrecision precision) override {
    RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, d, precision));
    RETURN_IF_ERROR(CheckSameShape(d, c, "gemm d", "gemm c"));
    RETURN_IF_ERROR(CheckDType(c, d.dtype, "gemm c"));
    return Matmul(op_a, op_b, alpha, a, 0, b, 0, beta, c, 0, d, 0, 1,
                  precision);
  }

  absl::Status GemmStridedBatchedOut(Op op_a, Op op_b, float alpha,
                                     const MatrixView& a, int64_t stride_a,
                                     const MatrixView& b, int64_t stride_b,
                                     float beta, const MatrixView& c,
                                     int64_t stride_c, const MatrixView& d,
                                     int64_t stride_d, int64_t batch,
                                     MatmulPrecision precision) override {
    RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, d, precision));
    RETURN_IF_ERROR(CheckSameShape(d, c, "gemm d", "gemm c"));
    RETURN_IF_ERROR(CheckDType(c, d.dtype, "gemm c"));
    RETURN_IF_ERROR(CheckBatch(batch));
    return Matmul(op_a, op_b, alpha, a, stride_a, b, stride_b, beta, c,
                  stride_c, d, stride_d, batch, precision);
  }

  absl::Status AddToDiagonal(const MatrixView& view, int64_t stride,
                             int64_t batch, float value) override {
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
  absl::Status SymmetricGemmStridedBatchedOut(
      Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
      const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
      int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
      MatmulPrecision precision) override {
    RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, d, precision));
    RETURN_IF_ERROR(CheckSameShape(d, c, "gemm d", "gemm c"));
    RETURN_IF_ERROR(CheckDType(c, d.dtype, "gemm c"));
    RETURN_IF_ERROR(CheckBatch(batch));
    const bool half = d.dtype == DType::kBFloat16 || d.dtype == DType::kFloat16;
    const int64_t k = op_a == Op::kN ? a.cols : a.rows;
    if (half && d.rows == d.cols && UseSymGemmKernel(d.rows, k) &&
        sym_gemm_sm90::DeviceSupported(device_)) {
      sym_gemm_sm90::Args s;
      s.elem = d.dtype == DType::kBFloat16 ? sym_gemm_sm90::Elem::kBFloat16
                                           : sym_gemm_sm90::Elem::kFloat16;
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
    return Backend::SymmetricGemmStridedBatchedOut(
        op_a, op_b, alpha, a, stride_a, b, stride_b, beta, c, stride_c, d,
        stride_d, batch, precision);
  }

  // Whether the kernel also beats the plain full product (no mirror), i.e.
  // whether a caller should prefer the symmetric call: the size and batch
  // rule of sym_gemm_rule.h on this device's SM count.
  bool FastSymmetricGemm(int64_t n, int64_t k, DType dtype,
                         int64_t batch) const override {
    // Contiguous operands meet the kernel's layout rules when n and k are
    // multiples of 8 (sym_gemm_sm90::Unsupported).
    return (dtype == DType::kBFloat16 || dtype == DType::kFloat16) &&
           n % 8 == 0 && k % 8 == 0 &&
           sym_gemm_sm90::BeatsFullGemm(n, batch, SmCount()) &&
           sym_gemm_sm90::DeviceSupported(device_);
  }

  // Multiprocessors of device_, queried once. A failed query counts as a
  // GPU no batch can fill, leaving only the single-product size rule.
  int64_t SmCount() const {
    if (sm_count_ == 0 &&
        cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount,
                               device_) != cudaSuccess) {
      sm_count_ = -1;
    }
    return sm_count_ > 0 ? sm_count_ : int64_t{1} << 40;
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

  using Backend::MuonMomentum;
  absl::Status MuonMomentum(const MatrixView& grad,
                            const MatrixView& momentum_in,
                            const MatrixView& momentum_out, double beta,
                            bool nesterov, const MatrixView& out) override {
    RETURN_IF_ERROR(CheckMomentum(grad, momentum_in, momentum_out, out));
    return CudaStatus(
        cuda_kernels::MuonMomentum(K(grad), K(momentum_in), K(momentum_out),
                                   float(1.0 - beta), float(beta), nesterov,
                                   K(out), stream_),
        "muon momentum");
  }

  using Backend::MuonMomentumBatch;
  absl::Status MuonMomentumBatch(absl::Span<const MatrixView> grads,
                                 absl::Span<const MatrixView> momenta_in,
                                 absl::Span<const MatrixView> momenta_out,
                                 double beta, bool nesterov,
                                 absl::Span<const MatrixView> outs) override {
    RETURN_IF_ERROR(CheckMomentumBatch(grads, momenta_in, momenta_out, outs));
    std::vector<cuda_kernels::KView> g, mi, mo, o;
    for (size_t i = 0; i < grads.size(); ++i) {
      RETURN_IF_ERROR(
          CheckMomentum(grads[i], momenta_in[i], momenta_out[i], outs[i]));
      g.push_back(K(grads[i]));
      mi.push_back(K(momenta_in[i]));
      mo.push_back(K(momenta_out[i]));
      o.push_back(K(outs[i]));
    }
    return CudaStatus(
        cuda_kernels::MuonMomentumMulti(
            g.data(), mi.data(), mo.data(), o.data(), int64_t(g.size()),
            float(1.0 - beta), float(beta), nesterov, stream_),
        "muon momentum batch");
  }

  absl::Status ApplyUpdateBatch(absl::Span<const MatrixView> params,
                                absl::Span<const MatrixView> updates,
                                absl::Span<const float> lrs, float decay,
                                WeightDecayMethod method) override {
    RETURN_IF_ERROR(CheckUpdateBatch(params, updates, lrs));
    std::vector<cuda_kernels::KView> p, u;
    for (size_t i = 0; i < params.size(); ++i) {
      RETURN_IF_ERROR(CheckUpdate(params[i], updates[i]));
      p.push_back(K(params[i]));
      u.push_back(K(updates[i]));
    }
    return CudaStatus(cuda_kernels::ApplyUpdateMulti(
                          p.data(), u.data(), lrs.data(), int64_t(p.size()),
                          decay, int(method), stream_),
                      "apply update batch");
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

  absl::StatusOr<bool> AllFiniteBelow(absl::Span<const MatrixView> views,
                                      float limit) override {
    for (const MatrixView& v : views)
      RETURN_IF_ERROR(CheckView(v, "all_finite"));
    RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(flag_, 0, sizeof(int), stream_),
                               "all_finite"));
    std::vector<cuda_kernels::KView> k;
    for (const MatrixView& v : views) k.push_back(K(v));
    RETURN_IF_ERROR(
        CudaStatus(cuda_kernels::MarkNonFiniteMulti(k.data(), int64_t(k.size()),
                                                    limit, flag_, stream_),
                   "all_finite"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host_flag_, flag_, sizeof(int),
                                               cudaMemcpyDeviceToHost, stream_),
                               "all_finite"));
    RETURN_IF_ERROR(
        CudaStatus(cudaStreamSynchronize(stream_), "all_finite sync"));
    return *host_flag_ == 0;
  }

  absl::Status RunGraph(uint64_t key,
                        const std::function<absl::Status()>& work) override {
    if (!graphs_on_ || uncapturable_.contains(key)) return work();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    RETURN_IF_ERROR(CudaStatus(cudaStreamIsCapturing(stream_, &capturing),
                               "run graph: capture status"));
    // Inside another RunGraph's capture: part of that graph.
    if (capturing != cudaStreamCaptureStatusNone) return work();
    cudaGraphExec_t exec = nullptr;
    if (auto it = graphs_.find(key); it != graphs_.end()) {
      graph_lru_.splice(graph_lru_.begin(), graph_lru_, it->second);
      exec = it->second->second;
    } else {
      exec = Capture(work);
      if (exec == nullptr) {
        uncapturable_.insert(key);
        ++graph_counts_.fallbacks;
        return work();
      }
      ++graph_counts_.captures;
      graph_lru_.emplace_front(key, exec);
      graphs_.emplace(key, graph_lru_.begin());
      if (graph_lru_.size() > kMaxGraphs) {
        // A launched exec may be destroyed: CUDA frees it after it ran.
        graphs_.erase(graph_lru_.back().first);
        cudaGraphExecDestroy(graph_lru_.back().second);
        graph_lru_.pop_back();
      }
    }
    ++graph_counts_.launches;
    return CudaStatus(cudaGraphLaunch(exec, stream_), "run graph: launch");
  }

  CudaGraphCounts graph_counts() const { return graph_counts_; }

  void PushRange(const char* name) override { nvtxRangePushA(name); }
  void PopRange() override { nvtxRangePop(); }

  absl::Status Synchronize() override {
    return CudaStatus(cudaStreamSynchronize(stream_), "synchronize");
  }

 private:
  // Captures `work` on the stream and instantiates it; nullptr when the
  // work failed or was not capturable (a host sync, an allocation, ...),
  // with the capture ended and the error state cleared, so the caller can
  // run `work` directly. ThreadLocal mode: only this thread's calls are
  // checked (other groups' threads may allocate meanwhile).
  cudaGraphExec_t Capture(const std::function<absl::Status()>& work) {
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) !=
        cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    const absl::Status status = work();
    cudaGraph_t graph = nullptr;
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    cudaGraphExec_t exec = nullptr;
    if (status.ok() && end == cudaSuccess && graph != nullptr &&
        cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
      exec = nullptr;
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();  // clear the (non-sticky) error of a failed capture
    return exec;
  }

  static absl::Status CheckBatch(int64_t batch) {
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
  absl::Status Matmul(Op op_a, Op op_b, float alpha, const MatrixView& a,
                      int64_t sa, const MatrixView& b, int64_t sb, float beta,
                      const MatrixView& c, int64_t sc, const MatrixView& d,
                      int64_t sd, int64_t batch, MatmulPrecision precision) {
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
                           cc.data, p.c, d.data, p.d, &p.algo,
                           cublas_workspace_, kCublasWorkspaceBytes, stream_),
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
            b.data, CudaType(b.dtype), int(Ld(b)), sb, a.data,
            CudaType(a.dtype), int(Ld(a)), sa, &beta, d.data, CudaType(d.dtype),
            int(Ld(d)), sd, int(batch), ComputeType(precision),
            CUBLAS_GEMM_DEFAULT),
        "gemm strided batched");
  }

  static absl::Status Layout(cudaDataType_t type, int64_t rows, int64_t cols,
                             int64_t ld, int64_t batch, int64_t stride,
                             cublasLtMatrixLayout_t* out) {
    RETURN_IF_ERROR(
        CublasStatus(cublasLtMatrixLayoutCreate(out, type, uint64_t(rows),
                                                uint64_t(cols), ld),
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
  absl::Status BuildPlan(Op op_a, Op op_b, int64_t m, int64_t n, int64_t /*k*/,
                         const MatrixView& a, int64_t sa, const MatrixView& b,
                         int64_t sb, const MatrixView& c, int64_t sc,
                         const MatrixView& d, int64_t sd, int64_t batch,
                         MatmulPrecision precision, LtPlan* plan) {
    RETURN_IF_ERROR(
        CublasStatus(cublasLtMatmulDescCreate(
                         &plan->desc, ComputeType(precision), CUDA_R_32F),
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
    RETURN_IF_ERROR(
        Layout(CudaType(c.dtype), n, m, Ld(c), batch, sc, &plan->c));
    RETURN_IF_ERROR(
        Layout(CudaType(d.dtype), n, m, Ld(d), batch, sd, &plan->d));
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
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
        lt_, plan->desc, plan->a, plan->b, plan->c, plan->d, pref, 1, &result,
        &found);
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
  absl::Status Autotune(float alpha, float beta, const MatrixView& a,
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

  // Graph cache of RunGraph: most recently used first, at most kMaxGraphs.
  static constexpr size_t kMaxGraphs = 64;
  bool graphs_on_ = true;
  std::list<std::pair<uint64_t, cudaGraphExec_t>> graph_lru_;
  absl::flat_hash_map<uint64_t, decltype(graph_lru_)::iterator> graphs_;
  absl::flat_hash_set<uint64_t> uncapturable_;
  CudaGraphCounts graph_counts_;

  cublasLtHandle_t lt_ = nullptr;
  bool use_lt_ = true;
  int autotune_ = 0;
  std::map<std::array<int64_t, 20>, LtPlan> lt_plans_;
  int device_;
  const CudaBackendOptions options_;
  // SmCount()'s cache: 0 = not queried yet, -1 = the query failed.
  mutable int sm_count_ = 0;
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

CudaGraphCounts GetCudaGraphCounts(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda == nullptr ? CudaGraphCounts{} : cuda->graph_counts();
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(
    int device, const CudaBackendOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(
        "MakeCudaBackend: no CUDA device is visible on this machine");
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MakeCudaBackend: device must be in [0, ", count, "), got ", device));
  }
  auto backend = std::make_unique<CudaBackend>(device, options);
  RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace muond
