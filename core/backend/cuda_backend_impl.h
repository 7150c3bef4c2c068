#pragma once
// CudaBackend, the class behind MakeCudaBackend (cuda_backend.h), declared
// once for the files that define it by job:
//   cuda_backend.cc              setup, teardown, memory, copies, the factory
//   cuda_backend_gemm.cc         cuBLASLt / cublasGemmEx GEMMs, lt_autotune
//   cuda_backend_gram.cc         symmetric GEMM, mirror, diagonal shift
//   cuda_backend_elementwise.cc  normalisation, momentum, updates, AdamW,
//                                the finiteness check
//   cuda_graph_cache.cc          RunGraph's capture and cache
// Private to core/backend: everyone else holds a Backend.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/backend/cuda_backend.h"
#include "core/backend/cuda_backend_options.h"
#include "core/backend/cuda_graph_cache.h"
#include "core/backend/cuda_kernels.h"
#include "core/backend/cuda_status.h"

namespace muond::cuda_backend_internal {

// Set once at creation, so cuBLAS never allocates inside a step.
constexpr size_t kCublasWorkspaceBytes = size_t(64) << 20;

// Leading dimension of a row-major view (cuBLAS wants >= 1).
inline int64_t Ld(const MatrixView& v) {
  return std::max<int64_t>({v.row_stride, v.cols, 1});
}

// The kernels' view of a MatrixView.
inline cuda_kernels::KView K(const MatrixView& v) {
  cuda_kernels::KView k{v.data, v.rows, v.cols, Ld(v),
                        static_cast<int>(DTypeSize(v.dtype))};
  k.f16 = v.dtype == DType::kFloat16;
  return k;
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
  CudaBackend(int device, const CudaBackendOptions& options);
  ~CudaBackend() override;

  // Stream, cuBLAS(Lt) handles, workspace and scratch buffers.
  absl::Status Init();

  void* stream() const override { return stream_; }
  std::string_view name() const override { return name_; }
  bool is_device() const override { return true; }
  bool SupportsPrecision(MatmulPrecision) const override { return true; }

  // Memory and copies (cuda_backend.cc).
  absl::StatusOr<void*> Allocate(int64_t bytes) override;
  absl::StatusOr<MemoryInfo> Memory() override;
  void Free(void* ptr) override;
  absl::StatusOr<void*> AllocateHost(int64_t bytes) override;
  void FreeHost(void* ptr) override;
  absl::StatusOr<std::unique_ptr<Backend>> NewStream() override;
  absl::Status OrderBefore(Backend& later) override;
  absl::Status Memset0(const MatrixView& v) override;
  absl::Status CopyFromHost(void* dst, const void* src, int64_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes) override;
  absl::Status Copy2D(const MatrixView& dst, const MatrixView& src) override;

  // GEMMs (cuda_backend_gemm.cc).
  absl::Status Gemm(Op op_a, Op op_b, float alpha, const MatrixView& a,
                    const MatrixView& b, float beta, const MatrixView& c,
                    MatmulPrecision precision) override;
  absl::Status GemmStridedBatched(Op op_a, Op op_b, float alpha,
                                  const MatrixView& a, int64_t stride_a,
                                  const MatrixView& b, int64_t stride_b,
                                  float beta, const MatrixView& c,
                                  int64_t stride_c, int64_t batch,
                                  MatmulPrecision precision) override;
  absl::Status GemmOut(Op op_a, Op op_b, float alpha, const MatrixView& a,
                       const MatrixView& b, float beta, const MatrixView& c,
                       const MatrixView& d, MatmulPrecision precision) override;
  absl::Status GemmStridedBatchedOut(Op op_a, Op op_b, float alpha,
                                     const MatrixView& a, int64_t stride_a,
                                     const MatrixView& b, int64_t stride_b,
                                     float beta, const MatrixView& c,
                                     int64_t stride_c, const MatrixView& d,
                                     int64_t stride_d, int64_t batch,
                                     MatmulPrecision precision) override;

  // Gram Newton-Schulz helpers (cuda_backend_gram.cc).
  absl::Status AddToDiagonal(const MatrixView& view, int64_t stride,
                             int64_t batch, float value) override;
  absl::Status SymmetricGemmStridedBatchedOut(
      Op op_a, Op op_b, float alpha, const MatrixView& a, int64_t stride_a,
      const MatrixView& b, int64_t stride_b, float beta, const MatrixView& c,
      int64_t stride_c, const MatrixView& d, int64_t stride_d, int64_t batch,
      MatmulPrecision precision) override;
  bool FastSymmetricGemm(int64_t n, int64_t k, DType dtype,
                         int64_t batch) const override;
  absl::Status SymmetrizeFromLower(const MatrixView& a, int64_t stride,
                                   int64_t batch) override;

  // Elementwise and multi-tensor steps (cuda_backend_elementwise.cc).
  absl::Status FrobeniusNormalize(const MatrixView& src, const MatrixView& dst,
                                  int64_t batch, float eps) override;
  using Backend::MuonMomentum;
  absl::Status MuonMomentum(const MatrixView& grad,
                            const MatrixView& momentum_in,
                            const MatrixView& momentum_out, double beta,
                            bool nesterov, const MatrixView& out,
                            const BlockScales& scales) override;
  using Backend::MuonMomentumBatch;
  absl::Status MuonMomentumBatch(absl::Span<const MatrixView> grads,
                                 absl::Span<const MatrixView> momenta_in,
                                 absl::Span<const MatrixView> momenta_out,
                                 double beta, bool nesterov,
                                 absl::Span<const MatrixView> outs,
                                 absl::Span<const BlockScales> scales) override;
  absl::Status CheckedMuonMomentumBatch(
      absl::Span<const MatrixView> grads,
      absl::Span<const MatrixView> momenta_in,
      absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
      absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales,
      float grad_limit, int slot) override;
  absl::Status CheckGradsInto(absl::Span<const MatrixView> views, float limit,
                              int slot) override;
  absl::StatusOr<std::vector<bool>> TakeGradChecks(int slots) override;
  absl::Status ApplyUpdateBatch(absl::Span<const MatrixView> params,
                                absl::Span<const MatrixView> updates,
                                absl::Span<const float> lrs, float decay,
                                WeightDecayMethod method) override;
  absl::Status ApplyRowScaledUpdateBatch(
      absl::Span<const MatrixView> params, absl::Span<const MatrixView> updates,
      absl::Span<const MatrixView> row_factors, absl::Span<const float> lrs,
      float decay, WeightDecayMethod method) override;
  absl::Status ApplyUpdate(const MatrixView& param, const MatrixView& update,
                           float lr, float decay,
                           WeightDecayMethod method) override;
  using Backend::AdamW;
  absl::Status AdamW(const MatrixView& param, const MatrixView& grad,
                     const MatrixView& exp_avg, const MatrixView& exp_avg_sq,
                     const AdamWScalars& s,
                     const AdamWMomentScales& scales) override;
  absl::Status NorMuonRowStats(absl::Span<const NorMuonRowBlock> blocks,
                               const MatrixView& state,
                               const MatrixView& stats) override;
  absl::Status SumSlices(const MatrixView& slices,
                         const MatrixView& out) override;
  absl::Status NorMuonFactors(absl::Span<const NorMuonRowBlock> blocks,
                              const MatrixView& stats, const MatrixView& state,
                              const MatrixView& staged,
                              const MatrixView& factors, double beta2,
                              double eps) override;
  absl::Status AdaMuonNormalize(const MatrixView& update,
                                const MatrixView& v_in, const MatrixView& v_out,
                                double beta2, float eps) override;
  absl::Status AdaMuonNormalizeBatch(absl::Span<const MatrixView> updates,
                                     absl::Span<const MatrixView> v_in,
                                     absl::Span<const MatrixView> v_out,
                                     double beta2, float eps) override;
  absl::StatusOr<bool> AllFiniteBelow(absl::Span<const MatrixView> views,
                                      float limit) override;

  absl::Status RunGraph(uint64_t key,
                        const std::function<absl::Status()>& work) override {
    return graphs_.Run(stream_, key, work);
  }
  CudaGraphCounts graph_counts() const { return graphs_.counts(); }

  void PushRange(const char* name) override;
  void PopRange() override;
  absl::Status Synchronize() override;
  absl::StatusOr<int> TimeMark() override;
  absl::StatusOr<double> MarkedUs(int from, int to) override;
  void ClearTimeMarks() override { time_marks_used_ = 0; }

 private:
  static absl::Status CheckBatch(int64_t batch);
  // The *Out products' arguments: CheckGemm on d, and c of d's shape and
  // dtype (the full and the symmetric products share them).
  static absl::Status CheckGemmOut(Op op_a, Op op_b, const MatrixView& a,
                                   const MatrixView& b, const MatrixView& c,
                                   const MatrixView& d,
                                   MatmulPrecision precision);

  // d = alpha op(a) op(b) + beta c over `batch` slices (arguments checked).
  absl::Status Matmul(Op op_a, Op op_b, float alpha, const MatrixView& a,
                      int64_t sa, const MatrixView& b, int64_t sb, float beta,
                      const MatrixView& c, int64_t sc, const MatrixView& d,
                      int64_t sd, int64_t batch, MatmulPrecision precision);
  static absl::Status Layout(cudaDataType_t type, int64_t rows, int64_t cols,
                             int64_t ld, int64_t batch, int64_t stride,
                             cublasLtMatrixLayout_t* out);
  absl::Status BuildPlan(Op op_a, Op op_b, int64_t m, int64_t n, int64_t k,
                         const MatrixView& a, int64_t sa, const MatrixView& b,
                         int64_t sb, const MatrixView& c, int64_t sc,
                         const MatrixView& d, int64_t sd, int64_t batch,
                         MatmulPrecision precision, LtPlan* plan);
  absl::Status Autotune(float alpha, float beta, const MatrixView& a,
                        const MatrixView& b, const MatrixView& c,
                        const MatrixView& d, LtPlan* plan);

  // Multiprocessors of device_, queried once (cuda_backend_gram.cc).
  int64_t SmCount() const;

  CudaGraphCache graphs_;

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
  // [0]: AllFiniteBelow's flag; [1 + slot]: each check slot's flag, set by
  // CheckedMuonMomentumBatch (the momentum kernels' GradCheck) and
  // CheckGradsInto calls until TakeGradChecks (1 + kDefaultGradCheckSlots
  // ints, 4 KiB).
  int* flag_ = nullptr;
  int* host_flag_ = nullptr;
  // Sets *flag (device memory) where an element of `views` breaks
  // AllFiniteBelow's test against `limit`; never clears it. No wait.
  absl::Status MarkNonFinite(absl::Span<const MatrixView> views, float limit,
                             int* flag, const char* what);
  // The momentum kernels' batch, checked (GradCheck) or not.
  absl::Status MomentumBatch(absl::Span<const MatrixView> grads,
                             absl::Span<const MatrixView> momenta_in,
                             absl::Span<const MatrixView> momenta_out,
                             double beta, bool nesterov,
                             absl::Span<const MatrixView> outs,
                             absl::Span<const BlockScales> scales,
                             cuda_kernels::GradCheck check);
  // OrderBefore's event, recorded anew by each call: a stream's wait takes
  // the record current when it is enqueued, so one event serves every call.
  cudaEvent_t order_event_ = nullptr;
  // TimeMark's events, created as first needed and reused after
  // ClearTimeMarks: two per timed phase of a step, so a few per group (a
  // thousand groups hold a few thousand events, ~100 bytes of host memory
  // each).
  std::vector<cudaEvent_t> time_marks_;
  int time_marks_used_ = 0;
};

}  // namespace muond::cuda_backend_internal
