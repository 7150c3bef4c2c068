// CudaBackend's elementwise and multi-tensor steps (normalisation, Muon
// momentum, updates, AdamW, the Muon variants, the finiteness check): argument
// checks, then one launch of muond's kernels (core/backend/cuda_kernels.h) on
// the stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/backend/cuda_backend_impl.h"
#include "core/backend/cuda_kernels.h"
#include "core/common/status_macros.h"

namespace muond::cuda_backend_internal {

absl::Status CudaBackend::FrobeniusNormalize(const MatrixView& src,
                                             const MatrixView& dst,
                                             int64_t batch, float eps) {
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

absl::Status CudaBackend::MuonMomentum(const MatrixView& grad,
                                       const MatrixView& momentum_in,
                                       const MatrixView& momentum_out,
                                       double beta, bool nesterov,
                                       const MatrixView& out,
                                       const BlockScales& scales) {
  if (momentum_in.dtype == DType::kFloat8E4M3) {
    return MuonMomentumBatch({grad}, {momentum_in}, {momentum_out}, beta,
                             nesterov, {out}, {scales});
  }
  RETURN_IF_ERROR(CheckMomentum(grad, momentum_in, momentum_out, out, scales));
  return CudaStatus(
      cuda_kernels::MuonMomentum(K(grad), K(momentum_in), K(momentum_out),
                                 float(1.0 - beta), float(beta), nesterov,
                                 K(out), stream_),
      "muon momentum");
}

absl::Status CudaBackend::MuonMomentumBatch(
    absl::Span<const MatrixView> grads, absl::Span<const MatrixView> momenta_in,
    absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
    absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales) {
  return MomentumBatch(grads, momenta_in, momenta_out, beta, nesterov, outs,
                       scales, {});
}

absl::Status CudaBackend::CheckedMuonMomentumBatch(
    absl::Span<const MatrixView> grads, absl::Span<const MatrixView> momenta_in,
    absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
    absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales,
    float grad_limit, int slot) {
  RETURN_IF_ERROR(CheckGradCheckSlot(slot, grad_check_slots()));
  return MomentumBatch(grads, momenta_in, momenta_out, beta, nesterov, outs,
                       scales, {grad_limit, flag_ + 1 + slot});
}

absl::Status CudaBackend::CheckGradsInto(absl::Span<const MatrixView> views,
                                         float limit, int slot) {
  RETURN_IF_ERROR(CheckGradCheckSlot(slot, grad_check_slots()));
  // Only ever sets the slot's flag (TakeGradChecks clears it).
  return MarkNonFinite(views, limit, flag_ + 1 + slot, "grad check");
}

absl::Status CudaBackend::MarkNonFinite(absl::Span<const MatrixView> views,
                                        float limit, int* flag,
                                        const char* what) {
  for (const MatrixView& v : views) RETURN_IF_ERROR(CheckView(v, what));
  if (views.empty()) return absl::OkStatus();
  std::vector<cuda_kernels::KView> k;
  for (const MatrixView& v : views) k.push_back(K(v));
  return CudaStatus(cuda_kernels::MarkNonFiniteMulti(
                        k.data(), int64_t(k.size()), limit, flag, stream_),
                    what);
}

absl::StatusOr<std::vector<bool>> CudaBackend::TakeGradChecks(int slots) {
  RETURN_IF_ERROR(CheckGradCheckSlots(slots, grad_check_slots()));
  const size_t bytes = size_t(slots) * sizeof(int);
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host_flag_ + 1, flag_ + 1, bytes,
                                             cudaMemcpyDeviceToHost, stream_),
                             "grad check"));
  RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(flag_ + 1, 0, bytes, stream_), "grad check"));
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream_), "grad check sync"));
  std::vector<bool> within(slots);
  for (int k = 0; k < slots; ++k) within[k] = host_flag_[1 + k] == 0;
  return within;
}

absl::Status CudaBackend::MomentumBatch(
    absl::Span<const MatrixView> grads, absl::Span<const MatrixView> momenta_in,
    absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
    absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales,
    cuda_kernels::GradCheck check) {
  RETURN_IF_ERROR(
      CheckMomentumBatch(grads, momenta_in, momenta_out, outs, scales));
  std::vector<cuda_kernels::KView> g, mi, mo, o;
  std::vector<const float*> si;
  std::vector<float*> so;
  bool fp8 = false;
  for (size_t i = 0; i < grads.size(); ++i) {
    const BlockScales s = scales.empty() ? BlockScales{} : scales[i];
    RETURN_IF_ERROR(
        CheckMomentum(grads[i], momenta_in[i], momenta_out[i], outs[i], s));
    // One state dtype per call: the fp8 kernel takes every tensor or none.
    if (i > 0 && fp8 != (momenta_in[i].dtype == DType::kFloat8E4M3)) {
      return absl::InvalidArgumentError(
          "momentum batch: fp8_e4m3 state cannot be mixed with other state "
          "in one call");
    }
    fp8 = momenta_in[i].dtype == DType::kFloat8E4M3;
    g.push_back(K(grads[i]));
    mi.push_back(K(momenta_in[i]));
    mo.push_back(K(momenta_out[i]));
    o.push_back(K(outs[i]));
    si.push_back(s.in);
    so.push_back(s.out);
  }
  if (fp8) {
    return CudaStatus(cuda_kernels::MuonMomentumFp8Multi(
                          g.data(), mi.data(), mo.data(), o.data(), si.data(),
                          so.data(), int64_t(g.size()), float(1.0 - beta),
                          float(beta), nesterov, stream_, check),
                      "muon momentum fp8");
  }
  return CudaStatus(
      cuda_kernels::MuonMomentumMulti(g.data(), mi.data(), mo.data(), o.data(),
                                      int64_t(g.size()), float(1.0 - beta),
                                      float(beta), nesterov, stream_, check),
      "muon momentum batch");
}

absl::Status CudaBackend::ApplyUpdateBatch(absl::Span<const MatrixView> params,
                                           absl::Span<const MatrixView> updates,
                                           absl::Span<const float> lrs,
                                           float decay,
                                           WeightDecayMethod method) {
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

absl::Status CudaBackend::ApplyRowScaledUpdateBatch(
    absl::Span<const MatrixView> params, absl::Span<const MatrixView> updates,
    absl::Span<const MatrixView> row_factors, absl::Span<const float> lrs,
    float decay, WeightDecayMethod method) {
  RETURN_IF_ERROR(CheckRowScaledUpdateBatch(params, updates, row_factors, lrs));
  std::vector<cuda_kernels::KView> p, u;
  std::vector<const float*> f;
  for (size_t i = 0; i < params.size(); ++i) {
    p.push_back(K(params[i]));
    u.push_back(K(updates[i]));
    f.push_back(static_cast<const float*>(row_factors[i].data));
  }
  return CudaStatus(cuda_kernels::ApplyRowScaledUpdateMulti(
                        p.data(), u.data(), f.data(), lrs.data(),
                        int64_t(p.size()), decay, int(method), stream_),
                    "row-scaled update batch");
}

absl::Status CudaBackend::ApplyUpdate(const MatrixView& param,
                                      const MatrixView& update, float lr,
                                      float decay, WeightDecayMethod method) {
  RETURN_IF_ERROR(CheckUpdate(param, update));
  return CudaStatus(cuda_kernels::ApplyUpdate(K(param), K(update), lr, decay,
                                              int(method), stream_),
                    "apply update");
}

absl::Status CudaBackend::AdamW(const MatrixView& param, const MatrixView& grad,
                                const MatrixView& exp_avg,
                                const MatrixView& exp_avg_sq,
                                const AdamWScalars& s,
                                const AdamWMomentScales& scales) {
  RETURN_IF_ERROR(CheckAdamW(param, grad, exp_avg, exp_avg_sq, scales));
  if (exp_avg.dtype == DType::kFloat8E4M3) {
    return CudaStatus(cuda_kernels::AdamWFp8(
                          K(param), K(grad), exp_avg.data, exp_avg_sq.data,
                          scales.exp_avg, scales.exp_avg_sq, s.param_decay,
                          s.one_minus_beta1, s.beta2, s.one_minus_beta2,
                          s.step_size, s.bias_correction2_sqrt, s.eps, stream_),
                      "adamw fp8");
  }
  return CudaStatus(
      cuda_kernels::AdamW(K(param), K(grad), K(exp_avg), K(exp_avg_sq),
                          s.param_decay, s.one_minus_beta1, s.beta2,
                          s.one_minus_beta2, s.step_size,
                          s.bias_correction2_sqrt, s.eps, stream_),
      "adamw");
}

namespace {

std::vector<cuda_kernels::KRowBlock> KBlocks(
    absl::Span<const NorMuonRowBlock> blocks) {
  std::vector<cuda_kernels::KRowBlock> out;
  out.reserve(blocks.size());
  for (const NorMuonRowBlock& b : blocks) {
    out.push_back({K(b.update), b.row_offset, b.stats_offset, b.full_rows,
                   b.full_cols, b.global0, b.valid, b.adds_sums, b.speaks_state,
                   b.skip});
  }
  return out;
}

float* Floats(const MatrixView& v) { return static_cast<float*>(v.data); }

}  // namespace

absl::Status CudaBackend::NorMuonRowStats(
    absl::Span<const NorMuonRowBlock> blocks, const MatrixView& state,
    const MatrixView& stats) {
  RETURN_IF_ERROR(CheckNorMuonBlocks(blocks, state, stats, {}, {}));
  const std::vector<cuda_kernels::KRowBlock> k = KBlocks(blocks);
  return CudaStatus(
      cuda_kernels::NorMuonRowStats(k.data(), int64_t(k.size()), Floats(state),
                                    Floats(stats), stats.rows, stream_),
      "normuon row stats");
}

absl::Status CudaBackend::SumSlices(const MatrixView& slices,
                                    const MatrixView& out) {
  RETURN_IF_ERROR(CheckSumSlices(slices, out));
  return CudaStatus(cuda_kernels::SumSlices(Floats(slices), slices.rows,
                                            slices.cols, Floats(out), stream_),
                    "sum slices");
}

absl::Status CudaBackend::NorMuonFactors(
    absl::Span<const NorMuonRowBlock> blocks, const MatrixView& stats,
    const MatrixView& state, const MatrixView& staged,
    const MatrixView& factors, double beta2, double eps) {
  RETURN_IF_ERROR(CheckNorMuonBlocks(blocks, state, stats, staged, factors));
  const std::vector<cuda_kernels::KRowBlock> k = KBlocks(blocks);
  return CudaStatus(
      cuda_kernels::NorMuonFactors(
          k.data(), int64_t(k.size()), Floats(stats), Floats(state),
          Floats(staged), Floats(factors), float(1.0 - beta2), eps, stream_),
      "normuon factors");
}

absl::Status CudaBackend::AdaMuonNormalizeBatch(
    absl::Span<const MatrixView> updates, absl::Span<const MatrixView> v_in,
    absl::Span<const MatrixView> v_out, double beta2, float eps) {
  RETURN_IF_ERROR(CheckAdaMuonBatch(updates, v_in, v_out));
  std::vector<cuda_kernels::KView> u, vi, vo;
  for (size_t i = 0; i < updates.size(); ++i) {
    u.push_back(K(updates[i]));
    vi.push_back(K(v_in[i]));
    vo.push_back(K(v_out[i]));
  }
  return CudaStatus(cuda_kernels::AdaMuonNormalizeMulti(
                        u.data(), vi.data(), vo.data(), int64_t(u.size()),
                        float(1.0 - beta2), eps, stream_),
                    "adamuon batch");
}

absl::Status CudaBackend::AdaMuonNormalize(const MatrixView& update,
                                           const MatrixView& v_in,
                                           const MatrixView& v_out,
                                           double beta2, float eps) {
  RETURN_IF_ERROR(CheckAdaMuon(update, v_in, v_out));
  return CudaStatus(
      cuda_kernels::AdaMuonNormalize(K(update), K(v_in), K(v_out),
                                     float(1.0 - beta2), eps, stream_),
      "adamuon");
}

absl::StatusOr<bool> CudaBackend::AllFiniteBelow(
    absl::Span<const MatrixView> views, float limit) {
  RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(flag_, 0, sizeof(int), stream_),
                             "all_finite"));
  RETURN_IF_ERROR(MarkNonFinite(views, limit, flag_, "all_finite"));
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host_flag_, flag_, sizeof(int),
                                             cudaMemcpyDeviceToHost, stream_),
                             "all_finite"));
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamSynchronize(stream_), "all_finite sync"));
  return *host_flag_ == 0;
}

}  // namespace muond::cuda_backend_internal
