// The kernels of the Muon variants (core/muon/muon_variant.h): NorMuon's row
// statistics, sums and row factors over a whole set of matrices (a param
// group) in a few launches (the update kernel applies the factors:
// ApplyRowScaledUpdateMulti), AdaMuon's elementwise second moment.
// Formulas: core/backend/elementwise_math.h.
#include <cstdint>

#include "core/backend/cuda_kernel_launch.cuh"
#include "core/backend/cuda_kernels.h"
#include "core/backend/elementwise_math.h"

namespace muond {
namespace cuda_kernels {
namespace {

// ---- NorMuon row sets -------------------------------------------------------
// Up to kRowTableBlocks row blocks per launch, passed by value in the kernel
// arguments (< 4 KB): CUDA block b works on row block k with
// start[k] <= b < start[k + 1]. Nothing is uploaded, so a set of any size
// costs ceil(count / kRowTableBlocks) launches per kernel.
constexpr int kRowTableBlocks = 32;
constexpr int kWarps = kThreads / 32;  // rows per CUDA block, a warp per row

struct RowEntry {
  DView update;
  int64_t row_offset, stats_offset, full_rows, full_cols, global0, valid;
  bool adds_sums, speaks_state, skip;
};

struct RowTable {
  RowEntry e[kRowTableBlocks];
  int start[kRowTableBlocks + 1];
  int count;
};

__device__ __forceinline__ int RowEntryOf(const RowTable& t, int b) {
  return EntryOfBlock(t.start, t.count, b);
}

// A 2-byte element's bits widened exactly: fp16 where the view is, else
// bf16.
__device__ __forceinline__ float Wide2(const DView& x, uint32_t bits) {
  return x.f16 ? HalfBitsToFloat<true>(bits) : HalfBitsToFloat<false>(bits);
}

// Elements j..j+3 of a row (fp32, bf16 or fp16), as one 16- or 8-byte load
// when the row start allows it (`vec`), else one by one; past the row: 0.
__device__ __forceinline__ void Ld4Row(const DView& x, const char* row,
                                       int64_t j, bool vec, float (&v)[4]) {
  if (vec && j + 4 <= x.cols) {
    if (x.elem == 4) {
      const float4 q = *reinterpret_cast<const float4*>(row + j * 4);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      const uint2 h = *reinterpret_cast<const uint2*>(row + j * 2);
      v[0] = Wide2(x, h.x & 0xffffu);
      v[1] = Wide2(x, h.x >> 16);
      v[2] = Wide2(x, h.y & 0xffffu);
      v[3] = Wide2(x, h.y >> 16);
    }
    return;
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t c = j + e;
    if (c >= x.cols) {
      v[e] = 0.0f;
    } else if (x.elem == 4) {
      v[e] = reinterpret_cast<const float*>(row)[c];
    } else {
      v[e] = Wide2(x, reinterpret_cast<const uint16_t*>(row)[c]);
    }
  }
}

// Row r's sum of squares by one warp, in fp64: lane l takes columns
// 4l + 128k + e (e = 0..3, k ascending; a column past the row adds +0), then
// the fixed xor butterfly; the order depends on the columns alone (not on
// the row's address or how it is loaded), so every layout that holds the row
// whole gets the same bits. kChunks chunks of 128 columns are loaded before
// any is summed, to keep loads in flight. Lane 0's value is the result.
__device__ double WarpRowSumSquares(const DView& x, int64_t r, int lane) {
  constexpr int kChunks = 4;
  const char* row = x.data + r * x.ld * x.elem;
  const bool vec =
      reinterpret_cast<uintptr_t>(row) % (x.elem == 4 ? 16 : 8) == 0;
  double sum = 0.0;
  for (int64_t base = 0; base < x.cols; base += 128 * kChunks) {
    float v[kChunks][4];
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      Ld4Row(x, row, base + 128 * c + 4 * lane, vec, v[c]);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const double d = v[c][e];
        sum = __dadd_rn(sum, __dmul_rn(d, d));
      }
    }
  }
  for (int off = 16; off > 0; off >>= 1)
    sum = __dadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, off));
  return sum;
}

// The row each warp of CUDA block b works on (-1: past the entry's rows).
struct WarpRow {
  int k;
  int64_t r;
};
__device__ __forceinline__ WarpRow WarpRowOf(const RowTable& t) {
  const int k = RowEntryOf(t, blockIdx.x);
  const int64_t r =
      int64_t(blockIdx.x - t.start[k]) * kWarps + threadIdx.x / 32;
  return {k, r < t.e[k].valid ? r : -1};
}

__global__ void RowStatsKernel(RowTable t, const float* state, float* stats) {
  const WarpRow w = WarpRowOf(t);
  if (w.r < 0) return;
  const RowEntry& e = t.e[w.k];
  const int lane = threadIdx.x % 32;
  const int64_t at = e.stats_offset + e.global0 + w.r;
  if (e.adds_sums) {
    const double sum = WarpRowSumSquares(e.update, w.r, lane);
    if (lane == 0) stats[at] = static_cast<float>(sum);
  }
  if (e.speaks_state && lane == 0)
    stats[at + e.full_rows] = state[e.row_offset + w.r];
}

__global__ void SumSlicesKernel(const float* slices, int64_t n, int64_t slots,
                                float* out) {
  for (int64_t k = blockIdx.x * int64_t(kThreads) + threadIdx.x; k < slots;
       k += int64_t(gridDim.x) * kThreads) {
    float sum = 0.0f;
    for (int64_t r = 0; r < n; ++r) sum = ew::Add(sum, slices[r * slots + k]);
    out[k] = sum;
  }
}

// A block's sum over threads' partials by the fixed shared-memory tree.
__device__ double BlockSumFixed(double x, double* shared) {
  shared[threadIdx.x] = x;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s)
      shared[threadIdx.x] =
          __dadd_rn(shared[threadIdx.x], shared[threadIdx.x + s]);
    __syncthreads();
  }
  const double sum = shared[0];
  __syncthreads();
  return sum;
}

// One CUDA block per row block: N1 and N2 over the full rows (thread-strided
// fp64 partials, then BlockSumFixed), then each local row's factor and state.
__global__ void FactorsKernel(RowTable t, const float* stats,
                              const float* state, float* staged, float* factors,
                              float w, double eps) {
  __shared__ double shared[kThreads];
  const RowEntry& e = t.e[blockIdx.x];
  const float* sums = stats + e.stats_offset;
  const float* v_old = sums + e.full_rows;
  double n1 = 0.0, n2 = 0.0;
  if (!e.skip) {
    for (int64_t i = threadIdx.x; i < e.full_rows; i += kThreads) {
      const float v = ew::NorMuonRowState(v_old[i], sums[i], e.full_cols, w);
      n1 = __dadd_rn(n1, double(sums[i]));
      n2 = __dadd_rn(n2, ew::NorMuonN2Term(sums[i], ew::NorMuonDenom(v, eps)));
    }
  }
  n1 = BlockSumFixed(n1, shared);
  n2 = BlockSumFixed(n2, shared);
  const double ratio = ew::NorMuonRatio(n1, n2, eps);
  for (int64_t r = threadIdx.x; r < e.update.rows; r += kThreads) {
    const int64_t row = e.row_offset + r;
    if (e.skip || r >= e.valid) {
      staged[row] = state[row];
      factors[row] = 1.0f;
      continue;
    }
    const int64_t i = e.global0 + r;
    const float v = ew::NorMuonRowState(v_old[i], sums[i], e.full_cols, w);
    staged[row] = v;
    factors[row] = ew::NorMuonRowFactor(ratio, ew::NorMuonDenom(v, eps));
  }
}

// Fills tables of the blocks `take` accepts, with ceil(valid / kWarps) CUDA
// blocks each (per_row: a warp per real row) or one, and launches
// `launch(table)` per full table.
template <typename Take, typename Launch>
cudaError_t RunRowTables(const KRowBlock* blocks, int64_t count, bool per_row,
                         Take take, Launch launch) {
  RowTable t;
  t.count = 0;
  t.start[0] = 0;
  for (int64_t i = 0; i <= count; ++i) {
    if (i < count && take(blocks[i])) {
      const KRowBlock& b = blocks[i];
      RowEntry& e = t.e[t.count];
      e = RowEntry{D(b.update),    b.row_offset, b.stats_offset, b.full_rows,
                   b.full_cols,    b.global0,    b.valid,        b.adds_sums,
                   b.speaks_state, b.skip};
      const int64_t n = per_row ? (b.valid + kWarps - 1) / kWarps : 1;
      t.start[t.count + 1] = t.start[t.count] + int(n);
      ++t.count;
    }
    const bool full = t.count == kRowTableBlocks;
    if ((full || i == count) && t.count > 0) {
      if (t.start[t.count] > 0) {
        const cudaError_t err = launch(t);
        if (err != cudaSuccess) return err;
      }
      t.count = 0;
    }
  }
  return cudaSuccess;
}

struct AdaMuonOp {
  DView u, v_in, v_out;
  float one_minus_beta2, eps;
  __device__ void operator()(int64_t i, int64_t j) const {
    const ew::AdaMuonOut o =
        ew::AdaMuonElement(Ld(u, i, j), Ld(v_in, i, j), one_minus_beta2, eps);
    St(v_out, i, j, o.v);
    St(u, i, j, o.u);
  }
};

}  // namespace

cudaError_t NorMuonRowStats(const KRowBlock* blocks, int64_t count,
                            const float* state, float* stats, int64_t slots,
                            cudaStream_t stream) {
  const cudaError_t err =
      cudaMemsetAsync(stats, 0, slots * int64_t(sizeof(float)), stream);
  if (err != cudaSuccess) return err;
  return RunRowTables(
      blocks, count, /*per_row=*/true,
      [](const KRowBlock& b) {
        return b.valid > 0 && (b.adds_sums || b.speaks_state);
      },
      [&](const RowTable& t) {
        RowStatsKernel<<<unsigned(t.start[t.count]), kThreads, 0, stream>>>(
            t, state, stats);
        return cudaGetLastError();
      });
}

cudaError_t SumSlices(const float* slices, int64_t n, int64_t slots, float* out,
                      cudaStream_t stream) {
  if (slots == 0) return cudaSuccess;
  const int64_t blocks = (slots + kThreads - 1) / kThreads;
  SumSlicesKernel<<<unsigned(blocks < 4096 ? blocks : 4096), kThreads, 0,
                    stream>>>(slices, n, slots, out);
  return cudaGetLastError();
}

cudaError_t NorMuonFactors(const KRowBlock* blocks, int64_t count,
                           const float* stats, const float* state,
                           float* staged, float* factors, float one_minus_beta2,
                           double eps, cudaStream_t stream) {
  return RunRowTables(
      blocks, count, /*per_row=*/false,
      [](const KRowBlock& b) { return b.update.rows > 0; },
      [&](const RowTable& t) {
        FactorsKernel<<<unsigned(t.count), kThreads, 0, stream>>>(
            t, stats, state, staged, factors, one_minus_beta2, eps);
        return cudaGetLastError();
      });
}

cudaError_t AdaMuonNormalize(const KView& update, const KView& v_in,
                             const KView& v_out, float one_minus_beta2,
                             float eps, cudaStream_t stream) {
  return LaunchForEach(
      {update, v_in, v_out}, update.rows, update.cols, stream,
      AdaMuonOp{D(update), D(v_in), D(v_out), one_minus_beta2, eps});
}

}  // namespace cuda_kernels
}  // namespace muond
