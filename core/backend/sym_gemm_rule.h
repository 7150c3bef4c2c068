// When the sm_90a symmetric GEMM (sym_gemm_sm90.h) beats the plain full
// product (cuBLASLt, no mirror): the rule behind CudaBackend's
// FastSymmetricGemm; and, at the end, which of its schedules `auto` runs.
// Pure functions, so that CPU tests can check them.
//
// Measured on an H200 (132 SMs; bench/results/gpu_h200_sym_gemm.md, bf16
// X X^T, kernel vs cuBLAS full product):
//   single products: n >= 3072 wins 1.22-1.54x; n = 2048 loses 0.83-0.93x
//     (136 lower tiles on 132 SMs: two waves, the second almost empty);
//     n <= 1024 loses (0.81-0.93x: 36 tiles or fewer cannot fill the GPU).
//   batches: 1024 x 3584 wins 1.12x at batch 8 (288 tiles, ~2 waves) and
//     1.39x at batch 32 (1152 tiles, ~9 waves); 512 x 1792 (10 tiles a
//     product) loses at batch 8 (0.85x) and ties at 32 (1.01x).
// Hence: n >= 3072, or n >= 1024 with the batch's lower tiles filling at
// least kMinWaves waves of the GPU. The margin (4 waves where ~2 already win
// at n = 1024) keeps the last, partial wave's idle SMs a small share.
// A batch of one decides as an unbatched call (n >= 3072 only: one n = 3072
// product is 300 tiles, under 4 waves of 132).
#ifndef MUOND_CORE_BACKEND_SYM_GEMM_RULE_H_
#define MUOND_CORE_BACKEND_SYM_GEMM_RULE_H_

#include <cstdint>

#include "core/backend/sym_gemm_tiles.h"

namespace muond {
namespace sym_gemm_sm90 {

// Single products: the kernel wins from this size on.
inline constexpr int64_t kBeatsFullMinN = 3072;
// Batched products: from this size on, given enough tiles.
inline constexpr int64_t kBatchedMinN = 1024;
inline constexpr int64_t kMinWaves = 4;

// Lower-triangle tiles (diagonal included) of an n x n result: t (t + 1) / 2
// with t = ceil(n / 128).
constexpr int64_t LowerTiles(int64_t n) {
  const int64_t t = (n + kSymTile - 1) / kSymTile;  // the kernel's tiles
  return t * (t + 1) / 2;
}

// Whether a batch of n x n products' lower tiles fill at least `waves`
// waves of a GPU with `sm_count` SMs (batch < 1 counts as 1).
constexpr bool LowerTilesFillWaves(int64_t n, int64_t batch, int64_t waves,
                                   int64_t sm_count) {
  const int64_t b = batch < 1 ? 1 : batch;
  return b * LowerTiles(n) >= waves * sm_count;
}

// Whether a batch of n x n symmetric products runs faster on the kernel than
// as full products on a GPU with `sm_count` SMs.
constexpr bool BeatsFullGemm(int64_t n, int64_t batch, int64_t sm_count) {
  if (n >= kBeatsFullMinN) return true;
  if (n < kBatchedMinN) return false;
  return LowerTilesFillWaves(n, batch, kMinWaves, sm_count);
}

// Wide (128 x 256) tiles vs cooperative 128 x 128 ones, measured side by side
// on an H100 (132 SMs; bench/results/gpu_h100_sym_gemm_wide.md). Wide wins
// most on the largest products: n = 8192 1.40-1.65x alone (2080 square
// tiles, ~16 waves), a Llama-3-70B layer's step 1.063x. Its smaller wins
// (n = 4096 at batch 4-16 1.16-1.17x, X X^T 2048 x 7168 and 1024 x 3584 at
// batch 32 1.12x, n = 2048 at batch 16-64 1.03-1.04x) did not carry into the
// steps: Llama-3-8B (n = 4096, batch 4) ran 1.002x, Qwen3-1.7B (n = 2048,
// batch 28) 4.6% slower. Everywhere else it ties or loses (0.53-1.00x: fewer,
// larger tiles leave more SMs idle in the last wave). Hence: wide from n =
// 8192, by size alone, so that a matrix's product takes the same schedule
// whichever batch it is in (the two schedules' results are not promised to be
// bitwise equal).
inline constexpr int64_t kWideMinN = 8192;

constexpr bool PrefersWideTiles(int64_t n) { return n >= kWideMinN; }

// Ping-pong vs cooperative below the wide sizes, measured side by side on an
// H100 with ping-pong's epilogue staged by 8 x 8 matrices (stmatrix;
// bench/results/gpu_h100_sym_gemm_sustained.md). A step keeps the GPU at its
// power limit (700 W), so what counts is each schedule's time over runs of
// seconds (sym_gemm_sm90_check time ... ITERS), not over a few dozen
// launches, which start at the boost clock and favour the cooperative
// schedule's idle epilogue. Sustained, ping-pong's time over cooperative's:
//   with c (the NS polynomial's products): n = 4096 alone 0.95, n = 2048 at
//     batch 16 0.92, n = 1024 at batch 64 1.00, n = 768 at batch 256 1.13
//     (there the cooperative schedule's prefetch of c,
//     MirrorEpilogue::PrefetchNextC, hides its load);
//   without c (X X^T, X^T X): 1024 x 2048 at batch 56 0.88, 4096 x 14336
//     alone 0.98, 2048 x 6144 at batch 21 1.05;
//   on fewer tiles than two waves ping-pong loses (one warpgroup a tile, so
//     a CTA's tile takes longer; 512 x 1792 at batch 8, short runs, 1.22).
// In the step sets (in-process Gram NS, A B B A), ping-pong for both kinds
// from n = 2048 beside the rule before (without c below 2048 only) took
// Qwen3-1.7B 0.986x the time, the MoE layer 0.994x and Llama-3-8B 1.003x
// (within its runs' spread). Hence ping-pong for products with c from
// kPingpongBySizeMinN, and for X X^T and X^T X without c wherever the
// batch's lower tiles fill kPingpongMinWaves waves.
// Only for those two forms without c may the batch decide: their ping-pong
// and cooperative d are bitwise equal (the same GMMA instructions in the
// same order, alpha acc rounded once; sym_gemm_sm90_check fails otherwise),
// so a batch of one and a batched call still give the same slices. Every
// other product (`by_size_only`: with c, or (N,N) like Gram NS's Q Z and
// R Z, without c only under custom coefficients with a or b = 0) takes its
// schedule by size alone. For products with c that is also where ping-pong
// measured faster than cooperative (ping-pong's time over cooperative's
// over thousands of launches: n = 2048 alone 0.94, the MoE layer's attention q
// and o, and at batch 2 0.91, against n = 1536 at batch 8 1.07, n = 1024 at
// batch 64 1.00 and n = 768 at batch 256 1.13): the edge is the size, not the
// waves (bench/results/gpu_h100_sym_gemm_sustained.md, sections 3 and 5). The
// checker's (N,N) + c cases of distinct commuting operands, Gram NS's
// polynomial form, came out bitwise equal between ping-pong and cooperative
// too (sym_gemm_sm90_check pingpong: 120 of 120 cases).
inline constexpr int64_t kPingpongMinWaves = 2;
inline constexpr int64_t kPingpongBySizeMinN = 2048;

constexpr bool PrefersPingpong(int64_t n, int64_t batch, bool by_size_only,
                               int64_t sm_count) {
  if (by_size_only) return n >= kPingpongBySizeMinN;
  return LowerTilesFillWaves(n, batch, kPingpongMinWaves, sm_count);
}

}  // namespace sym_gemm_sm90
}  // namespace muond

#endif  // MUOND_CORE_BACKEND_SYM_GEMM_RULE_H_
