#pragma once
// DelegatingBackend: a Backend whose every call goes to another, for tests
// that change one behaviour (count graph runs, report a memory figure, play a
// device with streams) over the CPU backend's math.
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string_view>
#include <utility>

#include "core/backend/backend.h"
#include "core/backend/cpu_backend.h"

namespace muond::testing {

// A backend that hands every call to another (the CPU backend by default),
// for tests that change one behaviour and keep the rest: subclass it and
// override what differs.
class DelegatingBackend : public Backend {
 public:
  explicit DelegatingBackend(std::unique_ptr<Backend> inner = MakeCpuBackend())
      : cpu_(std::move(inner)) {}

  absl::StatusOr<MemoryInfo> Memory() override { return cpu_->Memory(); }
  absl::StatusOr<void*> AllocateHost(int64_t bytes) override {
    return cpu_->AllocateHost(bytes);
  }
  void FreeHost(void* p) override { cpu_->FreeHost(p); }

  std::string_view name() const override { return cpu_->name(); }
  bool is_device() const override { return cpu_->is_device(); }
  bool SupportsPrecision(MatmulPrecision p) const override {
    return cpu_->SupportsPrecision(p);
  }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    return cpu_->Allocate(bytes);
  }
  void Free(void* p) override { cpu_->Free(p); }
  absl::Status Memset0(const MatrixView& v) override {
    return cpu_->Memset0(v);
  }
  absl::Status CopyFromHost(void* d, const void* s, int64_t n) override {
    return cpu_->CopyFromHost(d, s, n);
  }
  absl::Status CopyToHost(void* d, const void* s, int64_t n) override {
    return cpu_->CopyToHost(d, s, n);
  }
  absl::Status Copy2D(const MatrixView& d, const MatrixView& s) override {
    return cpu_->Copy2D(d, s);
  }
  absl::Status Gemm(Op oa, Op ob, float alpha, const MatrixView& a,
                    const MatrixView& b, float beta, const MatrixView& c,
                    MatmulPrecision p) override {
    return cpu_->Gemm(oa, ob, alpha, a, b, beta, c, p);
  }
  absl::Status GemmStridedBatched(Op oa, Op ob, float alpha,
                                  const MatrixView& a, int64_t sa,
                                  const MatrixView& b, int64_t sb, float beta,
                                  const MatrixView& c, int64_t sc,
                                  int64_t batch, MatmulPrecision p) override {
    return cpu_->GemmStridedBatched(oa, ob, alpha, a, sa, b, sb, beta, c, sc,
                                    batch, p);
  }
  absl::Status GemmOut(Op oa, Op ob, float alpha, const MatrixView& a,
                       const MatrixView& b, float beta, const MatrixView& c,
                       const MatrixView& d, MatmulPrecision p) override {
    return cpu_->GemmOut(oa, ob, alpha, a, b, beta, c, d, p);
  }
  absl::Status GemmStridedBatchedOut(Op oa, Op ob, float alpha,
                                     const MatrixView& a, int64_t sa,
                                     const MatrixView& b, int64_t sb,
                                     float beta, const MatrixView& c,
                                     int64_t sc, const MatrixView& d,
                                     int64_t sd, int64_t batch,
                                     MatmulPrecision p) override {
    return cpu_->GemmStridedBatchedOut(oa, ob, alpha, a, sa, b, sb, beta, c, sc,
                                       d, sd, batch, p);
  }
  absl::Status SymmetricGemmStridedBatchedOut(Op oa, Op ob, float alpha,
                                              const MatrixView& a, int64_t sa,
                                              const MatrixView& b, int64_t sb,
                                              float beta, const MatrixView& c,
                                              int64_t sc, const MatrixView& d,
                                              int64_t sd, int64_t batch,
                                              MatmulPrecision p) override {
    return cpu_->SymmetricGemmStridedBatchedOut(oa, ob, alpha, a, sa, b, sb,
                                                beta, c, sc, d, sd, batch, p);
  }
  absl::Status AddToDiagonal(const MatrixView& v, int64_t stride, int64_t batch,
                             float value) override {
    return cpu_->AddToDiagonal(v, stride, batch, value);
  }
  absl::Status SymmetrizeFromLower(const MatrixView& a, int64_t stride,
                                   int64_t batch) override {
    return cpu_->SymmetrizeFromLower(a, stride, batch);
  }
  absl::Status FrobeniusNormalize(const MatrixView& s, const MatrixView& d,
                                  int64_t batch, float eps) override {
    return cpu_->FrobeniusNormalize(s, d, batch, eps);
  }
  absl::Status MuonMomentum(const MatrixView& g, const MatrixView& m_in,
                            const MatrixView& m_out, double beta, bool nesterov,
                            const MatrixView& out,
                            const BlockScales& scales) override {
    return cpu_->MuonMomentum(g, m_in, m_out, beta, nesterov, out, scales);
  }
  absl::Status ApplyUpdate(const MatrixView& p, const MatrixView& u, float lr,
                           float decay, WeightDecayMethod method) override {
    return cpu_->ApplyUpdate(p, u, lr, decay, method);
  }
  absl::Status AdamW(const MatrixView& p, const MatrixView& g,
                     const MatrixView& m, const MatrixView& v,
                     const AdamWScalars& s,
                     const AdamWMomentScales& scales) override {
    return cpu_->AdamW(p, g, m, v, s, scales);
  }
  absl::Status ApplyRowScaledUpdateBatch(absl::Span<const MatrixView> p,
                                         absl::Span<const MatrixView> u,
                                         absl::Span<const MatrixView> factors,
                                         absl::Span<const float> lrs,
                                         float decay,
                                         WeightDecayMethod method) override {
    return cpu_->ApplyRowScaledUpdateBatch(p, u, factors, lrs, decay, method);
  }
  absl::Status NorMuonRowStats(absl::Span<const NorMuonRowBlock> blocks,
                               const MatrixView& state,
                               const MatrixView& stats) override {
    return cpu_->NorMuonRowStats(blocks, state, stats);
  }
  absl::Status SumSlices(const MatrixView& slices,
                         const MatrixView& out) override {
    return cpu_->SumSlices(slices, out);
  }
  absl::Status NorMuonFactors(absl::Span<const NorMuonRowBlock> blocks,
                              const MatrixView& stats, const MatrixView& state,
                              const MatrixView& staged,
                              const MatrixView& factors, double beta2,
                              double eps) override {
    return cpu_->NorMuonFactors(blocks, stats, state, staged, factors, beta2,
                                eps);
  }
  absl::Status AdaMuonNormalize(const MatrixView& u, const MatrixView& v_in,
                                const MatrixView& v_out, double beta2,
                                float eps) override {
    return cpu_->AdaMuonNormalize(u, v_in, v_out, beta2, eps);
  }
  // The step's grad check (CheckedMuonMomentumBatch, TakeGradChecks) is the
  // base class's: AllFiniteBelow, below, then the momentum.
  absl::StatusOr<bool> AllFiniteBelow(absl::Span<const MatrixView> views,
                                      float limit) override {
    return cpu_->AllFiniteBelow(views, limit);
  }
  absl::Status Synchronize() override { return cpu_->Synchronize(); }
  absl::Status RunGraph(uint64_t key,
                        const std::function<absl::Status()>& work) override {
    return cpu_->RunGraph(key, work);
  }

 protected:
  Backend& inner() { return *cpu_; }

 private:
  std::unique_ptr<Backend> cpu_;
};

// The CPU backend's math on a backend that calls itself a device: what a
// device decides (one lane per backend, auto NS batching) on a machine
// without a GPU.
class DeviceLikeCpuBackend final : public DelegatingBackend {
 public:
  bool is_device() const override { return true; }
};

// The backend a step engine test runs on: the CPU backend, or, where the
// test's environment sets MUOND_TEST_DEVICE_LIKE=1 (the `*_device_like`
// twins in tests/core/step/BUILD), DeviceLikeCpuBackend: one test source
// holds both of the engine's paths (a device's momentum in the domain
// agreement, the grad check in its pass) to the same references.
inline std::unique_ptr<Backend> MakeStepTestBackend() {
  const char* device_like = std::getenv("MUOND_TEST_DEVICE_LIKE");
  if (device_like != nullptr && std::string_view(device_like) == "1") {
    return std::make_unique<DeviceLikeCpuBackend>();
  }
  return MakeCpuBackend();
}

}  // namespace muond::testing
