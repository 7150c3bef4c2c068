#pragma once
// Where rank (g, t) of a G x T domain finds its shard of a full weight, the
// way Megatron shards it (docs/ARCHITECTURE.md "Sharding"): TP splits along
// tp_dim, then the GTP split of dim 0 of the TP-local block after `pad`
// trailing zero rows. Shared by the system and reliability tests, whose
// trainers register these shards.
#include <algorithm>
#include <cstdint>
#include <string>

namespace muond::testing {

struct Weight {
  std::string name;
  int64_t rows, cols;
  int tp_dim;  // -1 TP-replicated, 0 column-, 1 row-parallel
  bool gtp;
  int64_t pad;
};

// Rows [r0, r0 + nr) and cols [c0, c0 + nc) of the full matrix, of which the
// first `real` rows exist (the rest are padding).
struct Shard {
  int64_t r0, nr, c0, nc, real;
};

inline Shard ShardOf(const Weight& w, int G, int T, int g, int t) {
  int64_t tr0 = 0, tr = w.rows, c0 = 0, nc = w.cols;
  if (w.tp_dim == 0) {
    tr = w.rows / T;
    tr0 = t * tr;
  } else if (w.tp_dim == 1) {
    nc = w.cols / T;
    c0 = t * nc;
  }
  if (!w.gtp) return {tr0, tr, c0, nc, tr};
  const int64_t local = (tr + w.pad) / G;
  const int64_t start = g * local;
  const int64_t real = std::max<int64_t>(0, std::min(local, tr - start));
  return {tr0 + start, local, c0, nc, real};
}

}  // namespace muond::testing
