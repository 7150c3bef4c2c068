// The sm_90a symmetric GEMM's kernel, for the translation units that
// instantiate it (sym_gemm_sm90_cooperative.cu, sym_gemm_sm90_pingpong.cu):
// CUTLASS 3's sm90 warp-specialized mainloop (TMA loads, GMMA, a producer
// warpgroup and two consumer warpgroups) with two parts of our own:
//  - TriangleScheduler: a persistent grid of ~#SMs CTAs walks a linear index
//    over (batch x lower-triangle tiles, tile_m >= tile_n; banded order for
//    L2 reuse, sym_gemm_tiles.h); no CTA is launched for an upper tile.
//  - MirrorEpilogue: d = alpha acc + beta c rounded once to the output type,
//    staged in shared memory, written to tile (i, j) and, off the diagonal,
//    transposed to tile (j, i), both with coalesced 16-byte stores. Ping-pong
//    and wide stage by 8 x 8 matrices (stmatrix, then stmatrix.trans of the
//    same registers for the mirror), cooperative element by element
//    (StageElementwise says why). A diagonal tile writes its lower half and
//    that half's mirror, so every d is bitwise symmetric. With beta != 0, the
//    cooperative schedule's epilogue ends by cp.async-ing the CTA's next tile
//    of c into the staging buffer, so that c lands while the next mainloop runs
//    (PrefetchNextC).
// Three schedules of the consumers (Schedule in sym_gemm_sm90.h):
//  - cooperative: both consumer warpgroups share one 128 x 128 tile (64 rows
//    each), then both run its epilogue; the mainloop waits for it.
//  - wide: cooperative on 128 x 256 tiles, two square tiles side by side
//    (WideTileOfIndex): a third more MMA work per byte loaded into shared
//    memory, CUTLASS's own tile for large bf16 GEMMs. The epilogue writes the
//    two halves one after the other through the same staging buffer.
//  - ping-pong: each consumer warpgroup owns a whole 128 x 128 tile and the
//    two alternate (CUTLASS's ordered math barrier): one runs its epilogue
//    while the other's mainloop keeps the tensor cores busy. The epilogues
//    are serialized by that barrier, so the one staging buffer serves both.
// Only CUTLASS-including .cu files include this header.
#ifndef MUOND_CORE_BACKEND_SYM_GEMM_SM90_KERNEL_CUH_
#define MUOND_CORE_BACKEND_SYM_GEMM_SM90_KERNEL_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/backend/sym_gemm_sm90.h"
#include "core/backend/sym_gemm_sm90_launch.h"
#include "core/backend/sym_gemm_tiles.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.hpp"

namespace muond {
namespace sym_gemm_sm90 {

constexpr int kTile = kSymTile;  // square: the mirror of a tile is one

// ---------------------------------------------------------------------------
// Scheduler: linear work index -> (tile_m, tile_n, l) over lower tiles only;
// kWide: (tile_m, column pair, l) over 128 x 256 tiles (WideTileOfIndex).
struct TriangleTag {};
struct WideTriangleTag {};

template <bool kWide>
class TriangleScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Base::WorkTileInfo;
  using Arguments = typename Base::Arguments;
  struct Params : Base::Params {
    int64_t tiles = 0;  // tiles per side of one n x n output
    int64_t batch = 0;
  };

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(
      ProblemShapeMNKL shape, TileShape tile, ClusterShape cluster,
      cutlass::KernelHardwareInfo const& hw_info, Arguments const& args,
      void* workspace = nullptr, const uint32_t epilogue_subtile = 1,
      uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(
        shape, tile, cluster, hw_info, args, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    p.tiles = (int64_t(cute::get<0>(shape)) + cute::get<0>(tile) - 1) /
              cute::get<0>(tile);
    p.batch = int64_t(cute::get<3>(shape));
    return p;
  }

  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL, BlockShape,
                             ClusterShape, cutlass::KernelHardwareInfo hw_info,
                             Arguments = Arguments{}, bool = true) {
    const int64_t total = Work(params.tiles, params.batch);
    const int64_t sms = hw_info.sm_count > 0 ? hw_info.sm_count : 1;
    return dim3(unsigned(total < sms ? (total > 0 ? total : 1) : sms), 1, 1);
  }

  CUTLASS_HOST_DEVICE TriangleScheduler() {}

  CUTLASS_DEVICE explicit TriangleScheduler(Params const& params)
      : Base(params) {
#if defined(__CUDA_ARCH__)
    tiles_ = int32_t(params.tiles);
    batch_ = params.batch;
    idx_ = IndexAfter(0);
    step_ = gridDim.x;
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return WorkAt(idx_);
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return WorkAt(idx_); }
  CUTLASS_DEVICE void advance_to_next_work(uint32_t count = 1) {
    idx_ += step_ * int64_t(count);
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    advance_to_next_work();
    return cute::make_tuple(WorkAt(idx_), true);
  }
  template <class Pipeline, class PipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo info, Pipeline&,
                                      PipelineState) {
    return fetch_next_work(info);
  }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t count = 1) const {
    return !WorkAt(idx_ + step_ * int64_t(count)).is_valid();
  }

  // This CTA's work index `count` items into its walk (a persistent CTA
  // takes blockIdx.x, then steps by the grid), and the tile at an index of
  // a batch of n x n products in `tiles` x `tiles` square tiles: the walk's
  // one home, which the epilogue's c prefetch follows too
  // (MirrorEpilogue::PrefetchNextC).
  CUTLASS_DEVICE static int64_t IndexAfter(int64_t count) {
    return int64_t(blockIdx.x) + count * int64_t(gridDim.x);
  }
  // Batch l, then the triangle in TileOfIndex's banded order. 32-bit
  // arithmetic: a 64-bit division is a subroutine call, and a call anywhere
  // in the kernel makes ptxas serialize the wgmma pipeline (C7510).
  CUTLASS_DEVICE static WorkTileInfo WorkOf(int64_t idx, int32_t tiles,
                                            int64_t batch) {
    const int64_t per_batch = Work(tiles, 1);
    if (idx >= per_batch * batch) return WorkTileInfo::invalid_work_tile();
    const uint32_t i = uint32_t(idx), per = uint32_t(per_batch);
    const uint32_t l = i / per;
    int32_t m = 0, n = 0;
    if constexpr (kWide) {
      WideTileOfIndex(i - l * per, tiles, &m, &n);
    } else {
      TileOfIndex(i - l * per, tiles, &m, &n);
    }
    return {m, n, int32_t(l), true};
  }

 private:
  CUTLASS_HOST_DEVICE static int64_t Work(int64_t tiles, int64_t batch) {
    return kWide ? WideTileWork(tiles, batch) : LowerTileWork(tiles, batch);
  }

  CUTLASS_DEVICE WorkTileInfo WorkAt(int64_t idx) const {
    return WorkOf(idx, tiles_, batch_);
  }

  int32_t tiles_ = 0;
  int64_t batch_ = 0;
  int64_t idx_ = 0;
  int64_t step_ = 1;
};

// ---------------------------------------------------------------------------
// Epilogue (wrapped in CUTLASS's adapter for non-TMA epilogues). A tile of
// kTileN columns is kTileN / kTile square tiles, written one after the other.
// Scheduler: the kernel's (TriangleScheduler), whose walk the c prefetch
// follows.
template <class Element, class Scheduler, int kTileN = kTile>
class MirrorEpilogue {
  static_assert(kTileN % kTile == 0);

 public:
  using ElementC = Element;
  using ElementD = Element;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementOutput = Element;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using ThreadEpilogueOp =
      cutlass::epilogue::thread::LinearCombination<Element, 1, float, float>;
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  static constexpr int kPitch = kTile + 8;  // +16 B: conflict-free staging
  struct SharedStorage {
    alignas(128) Element tile[kTile * kPitch];
  };
  using TensorStorage = SharedStorage;

  struct Arguments {
    float alpha = 1.0f;
    float beta = 0.0f;
    Element const* c = nullptr;
    int64_t ldc = 0, stride_c = 0;
    Element* d = nullptr;
    int64_t ldd = 0, stride_d = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&,
                                                  Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(
      ProblemShape const&, Arguments const&, void*, cudaStream_t,
      cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE explicit MirrorEpilogue(Params const& params)
      : params_(params) {}
  CUTLASS_HOST_DEVICE MirrorEpilogue(Params const& params, SharedStorage const&)
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return params_.beta != 0.0f; }

  // Staging index of (r, c): 16-byte chunks XOR-swizzled by the 8-row group,
  // so that the transposed read (8 rows of one column per thread, four row
  // groups per quarter-warp) hits distinct banks.
  CUTLASS_DEVICE static int Idx(int r, int c) {
    return r * kPitch + ((((c >> 3) ^ (r >> 3)) & 15) << 3) + (c & 7);
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL,
            class FrgEngine, class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(
      ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK,
      BlockCoordMNKL blk_coord_mnkl,
      cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
      TiledMma tiled_mma, ResidueMNK, int thread_idx, char* smem_buf) {
    using namespace cute;
    const int n = int(get<0>(problem_shape_mnkl));
    const int tm = int(get<0>(blk_coord_mnkl));
    const int tn = int(get<1>(blk_coord_mnkl));
    const int64_t l = int64_t(get<3>(blk_coord_mnkl));
    Tensor cD = make_identity_tensor(make_shape(Int<kTile>{}, Int<kTileN>{}));
    Tensor tCcD = tiled_mma.get_thread_slice(thread_idx).partition_C(cD);
    CUTE_STATIC_ASSERT_V(size(tCcD) == size(accumulators));
    // Square tile j of the kTileN-wide one, if it is in the lower triangle
    // and inside the matrix (the same for every thread: the barriers within
    // match).
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < kTileN / kTile; ++h) {
      const int j = tn * (kTileN / kTile) + h;
      if (j > tm || tm * kTile >= n || j * kTile >= n) continue;
      WriteSquare<TiledMma>(n, tm, j, h * kTile, l, accumulators, tCcD,
                            thread_idx, smem_buf);
    }
    if constexpr (PrefetchesC<TiledMma>()) {
      PrefetchNextC<TiledMma>(n, int64_t(get<3>(problem_shape_mnkl)),
                              thread_idx, smem_buf);
    }
  }

 private:
  // Square tile (tm, tn) of d, and off the diagonal its mirror (tn, tm), from
  // the accumulators of columns col0.. of the tile.
  template <class TiledMma, class Acc, class Coords>
  CUTLASS_DEVICE void WriteSquare(int n, int tm, int tn, int col0, int64_t l,
                                  Acc const& accumulators, Coords const& tCcD,
                                  int thread_idx, char* smem_buf) {
    using namespace cute;
    constexpr int kThreads = int(size(TiledMma{}));
    const int m0 = tm * kTile, n0 = tn * kTile;
    Element* tile = reinterpret_cast<SharedStorage*>(smem_buf)->tile;
    Element* d = params_.d + l * params_.stride_d;

    const bool with_c = params_.beta != 0.0f;  // the same in every thread
    if (c_prefetched_) {
      // The previous epilogue's cp.async of this tile's c: landed long ago
      // (a mainloop ran since); every thread's copies visible to all.
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      cutlass::arch::NamedBarrier::sync(
          kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
    } else {
      // The previous tile's readers are done with the staging buffer.
      cutlass::arch::NamedBarrier::sync(
          kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
      // 1. With beta != 0, c's tile into the staging buffer by coalesced
      // 16-byte loads (zeros outside the matrix): the accumulators' layout
      // would read it as scattered 2-byte loads, one per element.
      if (with_c) {
        LoadTile<kThreads>(params_.c + l * params_.stride_c, params_.ldc, m0,
                           n0, n, tile, thread_idx);
        cutlass::arch::NamedBarrier::sync(
            kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
      }
    }

    if constexpr (PrefetchesC<TiledMma>()) {
      StageElementwise<kThreads>(n, tm, tn, col0, d, accumulators, tCcD,
                                 thread_idx, tile);
    } else {
      StageByMatrices<kThreads>(n, tm, tn, col0, d, accumulators, tCcD,
                                thread_idx, tile);
    }
  }

  // Steps 2-4 element by element: what the cooperative schedule runs. There
  // the matrix path (StageByMatrices) measured slower on products with a
  // long mainloop (H100: Gram NS's (N,N) + c at n = 4096 and X X^T of 4096 x
  // 14336, 7-8%; bench/results/gpu_h100_sym_gemm_stmatrix.md), while ping-pong
  // ran 1.10-1.75x faster with it.
  template <int kThreads, class Acc, class Coords>
  CUTLASS_DEVICE void StageElementwise(int n, int tm, int tn, int col0,
                                       Element* d, Acc const& accumulators,
                                       Coords const& tCcD, int thread_idx,
                                       Element* tile) {
    using namespace cute;
    const int m0 = tm * kTile, n0 = tn * kTile;
    const int64_t ldd = params_.ldd;
    const bool with_c = params_.beta != 0.0f;
    // 2. alpha acc + beta c, rounded once, into the staging buffer. A thread
    // reads and writes only its own elements: no barrier between the two.
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); ++i) {
      const int r = get<0>(tCcD(i)), col = get<1>(tCcD(i)) - col0;
      if (kTileN != kTile && (col < 0 || col >= kTile)) continue;
      const float c = with_c ? float(tile[Idx(r, col)]) : 0.0f;
      tile[Idx(r, col)] = Element(Combine(float(accumulators(i)), c, with_c));
    }
    cutlass::arch::NamedBarrier::sync(
        kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);

    // 3. Tile (tm, tn): rows m0.., cols n0.., 8 elements per store. On the
    // diagonal, the upper half is read from the lower half's mirror.
    const bool diag = tm == tn;
    constexpr int kChunks = kTile / 8;
    for (int v = thread_idx; v < kTile * kChunks; v += kThreads) {
      const int r = v / kChunks, c8 = (v % kChunks) * 8;
      if (m0 + r >= n || n0 + c8 >= n) continue;
      uint4 out;
      if (!diag) {
        out = *reinterpret_cast<uint4 const*>(&tile[Idx(r, c8)]);
      } else {
        uint32_t w[4];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 8; ++j) {
          const int cc = c8 + j;
          Pack(w, j, r >= cc ? tile[Idx(r, cc)] : tile[Idx(cc, r)]);
        }
        out = make_uint4(w[0], w[1], w[2], w[3]);
      }
      Store8(d + int64_t(m0 + r) * ldd + n0 + c8, out, n - (n0 + c8));
    }
    if (diag) return;

    // 4. The mirror, tile (tn, tm): output row n0 + col takes column col of
    // the staged tile. A warp covers 8 columns x 4 row chunks: 64 contiguous
    // bytes in each of 8 output rows.
    for (int v = thread_idx; v < kTile * kChunks; v += kThreads) {
      const int lane = v & 31, warp = v >> 5;
      const int col = (warp % (kTile / 8)) * 8 + (lane >> 2);
      const int r8 = ((warp / (kTile / 8)) * 4 + (lane & 3)) * 8;
      if (n0 + col >= n || m0 + r8 >= n) continue;
      uint32_t w[4];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 8; ++j) Pack(w, j, tile[Idx(r8 + j, col)]);
      Store8(d + int64_t(n0 + col) * ldd + m0 + r8,
             make_uint4(w[0], w[1], w[2], w[3]), n - (m0 + r8));
    }
  }

  // Steps 2-5 by 8 x 8 matrices (ping-pong and wide tiles): the
  // accumulators' layout is the one ldmatrix/stmatrix exchange with shared
  // memory, 8 elements a thread per instruction, where the elementwise path
  // spends an instruction or more per element.
  template <int kThreads, class Acc, class Coords>
  CUTLASS_DEVICE void StageByMatrices(int n, int tm, int tn, int col0,
                                      Element* d, Acc const& accumulators,
                                      Coords const& tCcD, int thread_idx,
                                      Element* tile) {
    using namespace cute;
    const int m0 = tm * kTile, n0 = tn * kTile;
    const int64_t ldd = params_.ldd;
    const bool with_c = params_.beta != 0.0f;
    // 2. alpha acc + beta c, rounded once, into the staging buffer as tile
    // S (row-major) by stmatrix, c read by ldmatrix. A warp reads and writes
    // only its own rows: no barrier between the two.
    constexpr int kGroups = decltype(size(accumulators))::value / 8;
    uint32_t packed[kGroups][4];
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      if (!InSquare(tCcD, g, col0)) continue;
      const uint32_t at = SmemAddr(tile, FragmentRow(tCcD, g, thread_idx),
                                   FragmentCol(tCcD, g, col0, thread_idx));
      uint32_t c[4] = {0, 0, 0, 0};
      if (with_c) LdMatrix(at, c);
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < 4; ++q) {
        packed[g][q] =
            CombinePair(accumulators(8 * g + 2 * q),
                        accumulators(8 * g + 2 * q + 1), c[q], with_c);
      }
      StMatrix<false>(at, packed[g]);
    }
    cutlass::arch::NamedBarrier::sync(
        kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);

    // 3. Tile (tm, tn) from S: rows m0.., cols n0.., 8 elements per store.
    // On the diagonal only the chunks at or below it (every column <= the
    // row); the rest come from the mirror in step 5.
    const bool diag = tm == tn;
    StoreChunks<kThreads>(tile, d, ldd, n, m0, n0, thread_idx,
                          diag ? kLower : kAll);
    cutlass::arch::NamedBarrier::sync(
        kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);

    // 4. The transpose T of the tile into the staging buffer (stmatrix.trans
    // of the same registers), once every thread is done reading S.
    CUTLASS_PRAGMA_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      if (!InSquare(tCcD, g, col0)) continue;
      StMatrix<true>(SmemAddr(tile, FragmentTransRow(tCcD, g, col0, thread_idx),
                              FragmentTransCol(tCcD, g, thread_idx)),
                     packed[g]);
    }
    cutlass::arch::NamedBarrier::sync(
        kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);

    // 5. Off the diagonal, the mirror tile (tn, tm) from T: rows n0.., cols
    // m0... On it, the chunks above the diagonal of tile (tm, tm): T's row r
    // is S's column r, so the upper half is the lower half's mirror and d is
    // bitwise symmetric.
    if (diag) {
      StoreChunks<kThreads>(tile, d, ldd, n, m0, m0, thread_idx, kUpper);
    } else {
      StoreChunks<kThreads>(tile, d, ldd, n, n0, m0, thread_idx, kAll);
    }
  }

  // The accumulators as ldmatrix/stmatrix fragments. A GMMA accumulator
  // fragment (CUTLASS's CLayout_64xN) runs, in a thread's value order,
  // (column, column + 1), (row + 8), (column + 8) before the next 8 x 16
  // block: so values 8g .. 8g + 7 are a 16 x 16 block's four 8 x 8 matrices
  // in x4 order (rows +0/+8, then columns +0/+8), two values a register. The
  // block's origin is value 8g's coordinates less the thread's place in an
  // 8 x 8 matrix (row lane / 4, column 2 (lane % 4)).
  template <class Coords>
  CUTLASS_DEVICE static bool InSquare(Coords const& tCcD, int g, int col0) {
    const int col = cute::get<1>(tCcD(8 * g)) - col0;
    return kTileN == kTile || (col >= 0 && col < kTile);
  }
  template <class Coords>
  CUTLASS_DEVICE static int BlockRow(Coords const& tCcD, int g, int lane) {
    return cute::get<0>(tCcD(8 * g)) - (lane >> 2);
  }
  template <class Coords>
  CUTLASS_DEVICE static int BlockCol(Coords const& tCcD, int g, int col0,
                                     int lane) {
    return cute::get<1>(tCcD(8 * g)) - col0 - 2 * (lane & 3);
  }
  // The row and column chunk whose address this thread gives an x4 matrix
  // instruction: lanes 8j .. 8j + 7 give matrix j's rows, matrix j being
  // rows +8 (j & 1) and columns +8 (j >> 1) of the block.
  template <class Coords>
  CUTLASS_DEVICE static int FragmentRow(Coords const& tCcD, int g,
                                        int thread_idx) {
    const int lane = thread_idx & 31;
    return BlockRow(tCcD, g, lane) + (lane & 7) + ((lane >> 3) & 1) * 8;
  }
  template <class Coords>
  CUTLASS_DEVICE static int FragmentCol(Coords const& tCcD, int g, int col0,
                                        int thread_idx) {
    const int lane = thread_idx & 31;
    return BlockCol(tCcD, g, col0, lane) + (lane >> 4) * 8;
  }
  // The same for the transpose: matrix j lands at T's rows (S's columns)
  // +8 (j >> 1) and columns (S's rows) +8 (j & 1).
  template <class Coords>
  CUTLASS_DEVICE static int FragmentTransRow(Coords const& tCcD, int g,
                                             int col0, int thread_idx) {
    const int lane = thread_idx & 31;
    return BlockCol(tCcD, g, col0, lane) + (lane & 7) + (lane >> 4) * 8;
  }
  template <class Coords>
  CUTLASS_DEVICE static int FragmentTransCol(Coords const& tCcD, int g,
                                             int thread_idx) {
    const int lane = thread_idx & 31;
    return BlockRow(tCcD, g, lane) + ((lane >> 3) & 1) * 8;
  }

  CUTLASS_DEVICE static uint32_t SmemAddr(Element const* tile, int r, int c) {
    return uint32_t(__cvta_generic_to_shared(&tile[Idx(r, c)]));
  }

  // alpha acc + beta c in fp32, spelled out (one product, one fused
  // multiply-add: no room for the compiler to contract differently), so that
  // both staging paths, hence every schedule, round the same value.
  CUTLASS_DEVICE float Combine(float acc, float c, bool with_c) const {
    const float v = __fmul_rn(params_.alpha, acc);
    return with_c ? __fmaf_rn(params_.beta, c, v) : v;
  }

  // Combine of two adjacent elements (c's two packed as in the fragment, low
  // half first), each rounded once to Element, packed.
  CUTLASS_DEVICE uint32_t CombinePair(float lo, float hi, uint32_t c,
                                      bool with_c) const {
    const float v0 = Combine(lo, float(Element::bitcast(uint16_t(c & 0xffff))),
                             with_c),
                v1 = Combine(hi, float(Element::bitcast(uint16_t(c >> 16))),
                             with_c);
    return uint32_t(Element(v0).raw()) | (uint32_t(Element(v1).raw()) << 16);
  }

  CUTLASS_DEVICE static void LdMatrix(uint32_t at, uint32_t (&r)[4]) {
    asm volatile(
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
        : "r"(at));
  }
  template <bool kTrans>
  CUTLASS_DEVICE static void StMatrix(uint32_t at, uint32_t const (&r)[4]) {
    if constexpr (kTrans) {
      asm volatile(
          "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, "
          "%4};\n" ::"r"(at),
          "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
          : "memory");
    } else {
      asm volatile(
          "stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, "
          "%4};\n" ::"r"(at),
          "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
          : "memory");
    }
  }

  // Which 8-element chunks of the staged tile a store pass writes: all, or
  // on a diagonal tile those at or below the diagonal (every column <= the
  // row: from S) or the rest (from T, a chunk that straddles the diagonal
  // taking its lower elements from T's columns, which are S's rows).
  enum Part { kAll, kLower, kUpper };

  // The staged tile's rows to d's rows r0.., columns c0.., 8 elements per
  // store (none outside the n x n matrix).
  template <int kThreads>
  CUTLASS_DEVICE static void StoreChunks(Element const* tile, Element* d,
                                         int64_t ldd, int n, int r0, int c0,
                                         int thread_idx, Part part) {
    constexpr int kChunks = kTile / 8;
    for (int v = thread_idx; v < kTile * kChunks; v += kThreads) {
      const int r = v / kChunks, c8 = (v % kChunks) * 8;
      if (r0 + r >= n || c0 + c8 >= n) continue;
      if (part == kLower && c8 + 7 > r) continue;
      if (part == kUpper && c8 + 7 <= r) continue;
      uint4 out = *reinterpret_cast<uint4 const*>(&tile[Idx(r, c8)]);
      if (part == kUpper && c8 <= r) {
        uint32_t w[4] = {out.x, out.y, out.z, out.w};
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 8; ++j) {
          if (c8 + j <= r) Replace(w, j, tile[Idx(c8 + j, r)]);
        }
        out = make_uint4(w[0], w[1], w[2], w[3]);
      }
      Store8(d + int64_t(r0 + r) * ldd + c0 + c8, out, n - (c0 + c8));
    }
  }

  // Whether the epilogue loads the next tile's c while the next mainloop
  // runs: the cooperative schedule on square tiles. There the consumers own
  // the staging buffer between epilogues, and a CTA's next tile is known
  // (Scheduler::IndexAfter and WorkOf, the walk the kernel takes). The c load
  // was the epilogue's largest stall (warps waiting on global loads, 31% of
  // stall cycles on Gram NS's 4096 x 4096 products). Ping-pong's two
  // consumer warpgroups share the buffer; wide tiles load c twice a tile.
  template <class TiledMma>
  CUTLASS_DEVICE static constexpr bool PrefetchesC() {
    return int(cute::size(TiledMma{})) == 256 && kTileN == kTile;
  }

  // After a tile's epilogue: once every thread is done reading the staging
  // buffer, cp.async the CTA's next tile's c into it (zeros outside the
  // matrix), so that its epilogue starts with c in shared memory.
  template <class TiledMma>
  CUTLASS_DEVICE void PrefetchNextC(int n, int64_t batch, int thread_idx,
                                    char* smem_buf) {
    constexpr int kThreads = int(cute::size(TiledMma{}));
    c_prefetched_ = false;
    if (params_.beta == 0.0f) return;
#if defined(__CUDA_ARCH__)
    const auto next = Scheduler::WorkOf(Scheduler::IndexAfter(++tiles_done_),
                                        (n + kTile - 1) / kTile, batch);
    if (!next.is_valid()) return;
    const int32_t tm = next.M_idx, tn = next.N_idx, l = next.L_idx;
    cutlass::arch::NamedBarrier::sync(
        kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
    Element const* src = params_.c + int64_t(l) * params_.stride_c;
    Element* tile = reinterpret_cast<SharedStorage*>(smem_buf)->tile;
    const int m0 = tm * kTile, n0 = tn * kTile;
    constexpr int kChunks = kTile / 8;
    for (int v = thread_idx; v < kTile * kChunks; v += kThreads) {
      const int r = v / kChunks, c8 = (v % kChunks) * 8;
      const int left = m0 + r < n ? n - (n0 + c8) : 0;
      const int bytes = left >= 8 ? 16 : (left > 0 ? 2 * left : 0);
      Element const* from =
          bytes > 0 ? src + int64_t(m0 + r) * params_.ldc + n0 + c8 : src;
      const uint32_t to = uint32_t(__cvta_generic_to_shared(&tile[Idx(r, c8)]));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to),
                   "l"(from), "r"(bytes));
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    c_prefetched_ = true;
#endif
  }

  // Rows m0.. and columns n0.. of the n x n matrix at `src` (row stride ld)
  // into the staging tile, 8 elements a load; what lies outside is 0. The
  // loads of a round are all issued before its shared-memory stores, so they
  // are in flight together; rounds of kRound bound the registers they hold
  // beside the accumulators (ping-pong's one warpgroup holds 128 of them).
  template <int kThreads>
  CUTLASS_DEVICE static void LoadTile(Element const* src, int64_t ld, int m0,
                                      int n0, int n, Element* tile,
                                      int thread_idx) {
    constexpr int kChunks = kTile / 8;
    constexpr int kPerThread = kTile * kChunks / kThreads;
    constexpr int kRound = kThreads >= 256 ? 8 : 4;
    static_assert(kTile * kChunks % kThreads == 0 && kPerThread % kRound == 0);
    CUTLASS_PRAGMA_UNROLL
    for (int r0 = 0; r0 < kPerThread; r0 += kRound) {
      uint4 chunk[kRound];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRound; ++i) {
        const int v = thread_idx + (r0 + i) * kThreads;
        const int r = v / kChunks, c8 = (v % kChunks) * 8;
        const int left = m0 + r < n ? n - (n0 + c8) : 0;
        chunk[i] = Load8(src + int64_t(m0 + r) * ld + n0 + c8, left);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRound; ++i) {
        const int v = thread_idx + (r0 + i) * kThreads;
        *reinterpret_cast<uint4*>(&tile[Idx(v / kChunks, (v % kChunks) * 8)]) =
            chunk[i];
      }
    }
  }

  // min(8, left) elements from `src` (none when left <= 0), zeros after; a
  // full chunk as one 16-byte load (ld and the base are multiples of 8
  // elements: checked by Unsupported()).
  CUTLASS_DEVICE static uint4 Load8(Element const* src, int left) {
    if (left >= 8) return __ldg(reinterpret_cast<uint4 const*>(src));
    uint32_t w[4] = {0, 0, 0, 0};
    uint16_t const* in = reinterpret_cast<uint16_t const*>(src);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; ++j) {
      if (j < left) w[j >> 1] |= uint32_t(in[j]) << (16 * (j & 1));
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }

  // Element j of an 8-element chunk packed in four 32-bit words (register
  // arrays indexed by unrolled constants: no local memory).
  CUTLASS_DEVICE static void Pack(uint32_t (&w)[4], int j, Element e) {
    const uint32_t bits = e.raw();
    w[j >> 1] = (j & 1) ? (w[j >> 1] | (bits << 16)) : bits;
  }

  // Element j of an 8-element chunk replaced.
  CUTLASS_DEVICE static void Replace(uint32_t (&w)[4], int j, Element e) {
    const int shift = 16 * (j & 1);
    w[j >> 1] =
        (w[j >> 1] & ~(0xffffu << shift)) | (uint32_t(e.raw()) << shift);
  }

  // Stores min(8, left) elements; a full chunk as one 16-byte store (ld and
  // the base are multiples of 8 elements: checked by Unsupported()). The
  // store is spelled out: from a uint4 assignment the compiler can emit four
  // 4-byte stores, which it did for the staged tile's stores.
  CUTLASS_DEVICE static void Store8(Element* dst, uint4 v, int left) {
    if (left >= 8) {
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst),
                   "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                   : "memory");
      return;
    }
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint16_t* out = reinterpret_cast<uint16_t*>(dst);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; ++j) {
      if (j < left) out[j] = uint16_t(w[j >> 1] >> (16 * (j & 1)));
    }
  }

  Params params_;
  // The staging buffer holds the current tile's c (PrefetchNextC), and the
  // epilogues this CTA ran (its work index's step count).
  bool c_prefetched_ = false;
  int64_t tiles_done_ = 0;
};

}  // namespace sym_gemm_sm90
}  // namespace muond

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages,
          class ProblemShapeType>
struct TileSchedulerSelector<muond::sym_gemm_sm90::TriangleTag, ArchTag,
                             TileShape, ClusterShape, Stages,
                             ProblemShapeType> {
  using Scheduler = muond::sym_gemm_sm90::TriangleScheduler<false>;
};
template <class ArchTag, class TileShape, class ClusterShape, uint32_t Stages,
          class ProblemShapeType>
struct TileSchedulerSelector<muond::sym_gemm_sm90::WideTriangleTag, ArchTag,
                             TileShape, ClusterShape, Stages,
                             ProblemShapeType> {
  using Scheduler = muond::sym_gemm_sm90::TriangleScheduler<true>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace muond {
namespace sym_gemm_sm90 {

using cutlass::layout::ColumnMajor;
using cutlass::layout::RowMajor;

// In CUTLASS terms A is M x K and B is N x K. A row-major op(a) = a (N) is
// K-major (RowMajor); op(a) = a^T (T) is M-major (ColumnMajor). For B,
// op(b) = b^T (T) means B[n][k] = b[n * ldb + k]: K-major (ColumnMajor);
// op(b) = b (N) is N-major (RowMajor).
// kTileN: the output tile's columns (kTile, or 2 kTile for the wide
// schedule).
template <class Element, bool kTransA, bool kTransB, class KernelSchedule,
          int kTileN>
struct Config {
  using LayoutA = cute::conditional_t<kTransA, ColumnMajor, RowMajor>;
  using LayoutB = cute::conditional_t<kTransB, ColumnMajor, RowMajor>;
  using TileShape = cute::Shape<cute::_128, cute::Int<kTileN>, cute::_64>;
  // No clusters: the scheduler's walk (one CTA's indices) is the one the
  // epilogue's c prefetch follows.
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using MirrorOut =
      MirrorEpilogue<Element, TriangleScheduler<kTileN != kTile>, kTileN>;
  using Epilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
          MirrorOut>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8,
      Element, LayoutB, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename MirrorOut::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, Mainloop, Epilogue,
      cute::conditional_t<kTileN == kTile, TriangleTag, WideTriangleTag>>;
};

// A stride tuple with the one dynamic non-batch mode set to `ld`.
template <class Stride>
Stride MakeStride(int64_t ld, int64_t batch_stride) {
  Stride s{};
  using M0 = cute::remove_cvref_t<decltype(cute::get<0>(s))>;
  if constexpr (cute::is_static<M0>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  cute::get<2>(s) = batch_stride;
  return s;
}

template <class Element, bool kTransA, bool kTransB, class KernelSchedule,
          int kTileN>
cudaError_t Launch(const Args& a, const Device& dev, cudaStream_t stream) {
  using C = Config<Element, kTransA, kTransB, KernelSchedule, kTileN>;
  using Kernel = typename C::Kernel;
  using Mainloop = typename C::Mainloop;
  cudaError_t err = cudaSuccess;
  // A batch stride of 0 (batch 1) is replaced by one matrix's extent: TMA
  // descriptors want a non-degenerate, 16-byte multiple stride.
  const int64_t rows_a = kTransA ? a.k : a.n, rows_b = kTransB ? a.n : a.k;
  const int64_t sa = a.batch > 1 ? a.stride_a : a.lda * rows_a;
  const int64_t sb = a.batch > 1 ? a.stride_b : a.ldb * rows_b;
  typename Kernel::Arguments args;
  args.mode = a.batch > 1 ? cutlass::gemm::GemmUniversalMode::kBatched
                          : cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {int(a.n), int(a.n), int(a.k), int(a.batch)};
  args.mainloop.ptr_A = static_cast<Element const*>(a.a);
  args.mainloop.dA = MakeStride<typename Mainloop::StrideA>(a.lda, sa);
  args.mainloop.ptr_B = static_cast<Element const*>(a.b);
  args.mainloop.dB = MakeStride<typename Mainloop::StrideB>(a.ldb, sb);
  args.epilogue.alpha = a.alpha;
  args.epilogue.beta = a.beta;
  args.epilogue.c = static_cast<Element const*>(a.c);
  args.epilogue.ldc = a.ldc;
  args.epilogue.stride_c = a.stride_c;
  args.epilogue.d = static_cast<Element*>(a.d);
  args.epilogue.ldd = a.ldd;
  args.epilogue.stride_d = a.stride_d;
  args.hw_info.device_id = dev.id;
  args.hw_info.sm_count = dev.sm_count;
  // Kernel::can_implement is not asked: it also wants the contiguous extent
  // (k or n) to be a multiple of 8, which TMA does not need (only 16-byte
  // strides and bases, checked by Unsupported(); edges are zero-filled).
  // No workspace is passed: neither schedule's kernel, with this scheduler
  // and epilogue, asks for one (a CUTLASS change that did would fail here,
  // not write through a null pointer).
  if (Kernel::get_workspace_size(args) != 0) return cudaErrorNotSupported;
  typename Kernel::Params params =
      Kernel::to_underlying_arguments(args, nullptr);
  const int smem = int(Kernel::SharedStorageSize);
  // Once per device and instantiation: the first call may already be inside a
  // CUDA graph capture (Backend::RunGraph), where fewer calls are better.
  static std::atomic<uint64_t> smem_set{0};
  const uint64_t bit = uint64_t(1) << (dev.id & 63);
  if ((smem_set.load() & bit) == 0) {
    err =
        cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    smem_set.fetch_or(bit);
  }
  cutlass::device_kernel<Kernel>
      <<<Kernel::get_grid_shape(params), Kernel::get_block_shape(), smem,
         stream>>>(params);
  return cudaGetLastError();
}

// Launch for the op pair of `a` (Unsupported() refused (T,T)).
template <class KernelSchedule, int kTileN = kTile>
cudaError_t LaunchOps(const Args& a, const Device& dev, cudaStream_t stream) {
  auto ops = [&](auto element) {
    using E = decltype(element);
    if (a.trans_a)
      return Launch<E, true, false, KernelSchedule, kTileN>(a, dev, stream);
    return a.trans_b
               ? Launch<E, false, true, KernelSchedule, kTileN>(a, dev, stream)
               : Launch<E, false, false, KernelSchedule, kTileN>(a, dev,
                                                                 stream);
  };
  return a.elem == Elem::kBFloat16 ? ops(cutlass::bfloat16_t{})
                                   : ops(cutlass::half_t{});
}

}  // namespace sym_gemm_sm90
}  // namespace muond

#endif  // MUOND_CORE_BACKEND_SYM_GEMM_SM90_KERNEL_CUH_
