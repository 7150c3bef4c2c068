#pragma once
// The D x G x T layouts and mixed params the engine's multi-rank tests
// (dp_share_test, variant_layouts_test) step: each full matrix from a fixed
// seed, its shard spec and tags, and rank (g, t)'s shard of it.
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/planner.h"
#include "core/plan/sharding.h"
#include "core/step/layer_sharded_muon.h"
#include "gtest/gtest.h"

namespace muond::testing_layouts {

struct Layout {
  int D, G, T;
  int world() const { return D * G * T; }
};

struct ParamCase {
  std::string name;
  int64_t rows, cols;  // full shape
  int tp_dim;          // -1, 0, 1
  bool gtp;            // GTP_remat-sharded (only when G > 1)
};

inline int64_t Pad(int64_t tp_rows, int G) { return (G - tp_rows % G) % G; }

// The full matrix `name` at `step` (0: the initial value), the same on every
// rank.
inline std::vector<float> FullMatrix(const std::string& name, int step,
                                     int64_t rows, int64_t cols) {
  std::seed_seq seq(name.begin(), name.end());
  std::vector<uint32_t> seeds(1);
  seq.generate(seeds.begin(), seeds.end());
  std::mt19937 rng(seeds[0] * 7919u + step * 31u);
  std::normal_distribution<float> dist(0.0f, step == 0 ? 0.5f : 1.0f);
  std::vector<float> m(rows * cols);
  for (float& x : m) x = dist(rng);
  return m;
}

inline ShardTags TagsOf(const ParamCase& p, const Layout& l) {
  ShardTags tags;
  tags.tensor_model_parallel = p.tp_dim >= 0;
  tags.partition_dim = p.tp_dim;
  tags.is_gtp_weight_remat = p.gtp;
  const int64_t tp_rows = (l.T > 1 && p.tp_dim == 0) ? p.rows / l.T : p.rows;
  tags.pad_length = p.gtp ? Pad(tp_rows, l.G) : 0;
  return tags;
}

inline ParamShardSpec SpecOf(const ParamCase& p, const Layout& l) {
  const ShardTags tags = TagsOf(p, l);
  absl::StatusOr<ParamShardSpec> spec =
      MakeShardSpecFromFullShape(p.name, {p.rows, p.cols}, p.tp_dim, p.gtp,
                                 tags.pad_length, DomainSize{l.G, l.T});
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

// The Muon hyperparameters of the layout tests, at ns_batch_size 1 (the
// bitwise contract with the single-process path) in `precision`.
inline MuonOptions LayoutMuon(
    MatmulPrecision precision = MatmulPrecision::kHighest) {
  MuonOptions o;
  o.ns.precision = precision;
  o.lr = 0.02;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 0.1;
  o.ns_batch_size = 1;
  return o;
}

// The binding of param `p` whose rank-local fp32 shard (`rows` x `cols`)
// and grad live in `param` and `grad` (the engine's views point into them).
inline ParamBinding BindingOf(const ParamCase& p, const Layout& l,
                              std::vector<float>& param,
                              std::vector<float>& grad,
                              std::pair<int64_t, int64_t> shape) {
  ParamBinding b;
  b.name = p.name;
  b.full_shape = {p.rows, p.cols};
  b.tags = TagsOf(p, l);
  const auto [r, c] = shape;
  b.param = ContiguousView(param.data(), DType::kFloat32, r, c);
  b.grad = ContiguousView(grad.data(), DType::kFloat32, r, c);
  return b;
}

// Rank (g, t)'s shard of a full matrix (the same on every replica): TP split
// along tp_dim, then the GTP_remat rows after the pad (pad rows zero).
inline std::vector<float> Shard(const std::vector<float>& full,
                                const ParamCase& p, const Layout& l, int g,
                                int t, int64_t* rows, int64_t* cols) {
  const int tp = l.T > 1 ? p.tp_dim : -1;
  int64_t r0 = 0, c0 = 0, tr = p.rows, tc = p.cols;
  if (tp == 0) {
    tr = p.rows / l.T;
    r0 = t * tr;
  }
  if (tp == 1) {
    tc = p.cols / l.T;
    c0 = t * tc;
  }
  int64_t lr = tr, lr0 = 0;
  if (p.gtp) {
    lr = (tr + Pad(tr, l.G)) / l.G;
    lr0 = g * lr;
  }
  std::vector<float> out(lr * tc, 0.0f);
  for (int64_t i = 0; i < lr && lr0 + i < tr; ++i) {
    for (int64_t j = 0; j < tc; ++j) {
      out[i * tc + j] = full[(r0 + lr0 + i) * p.cols + c0 + j];
    }
  }
  *rows = lr;
  *cols = tc;
  return out;
}

// Mixed params: replicated, GTP_remat with a pad row (G > 1), TP column and
// row (GTP_remat x TP when G > 1) and a second column-parallel one.
inline std::vector<ParamCase> MixedParams(const Layout& l) {
  const bool gtp = l.G > 1;
  return {{"rep", 6, 5, -1, false},
          {"gtp", 9, 6, -1, gtp},
          {"col", 8, 6, 0, gtp},
          {"row", 6, 8, 1, gtp},
          {"col2", 12, 4, 0, gtp}};
}

// LPT homes over one replica's G x T grid, each param's home replica
// (i + 1) mod D: the first param lives on replica 1, the others spread.
inline std::vector<NsHome> Homes(const std::vector<ParamCase>& params,
                                 const Layout& l) {
  std::vector<ParamShardSpec> specs;
  for (const ParamCase& p : params) specs.push_back(SpecOf(p, l));
  absl::StatusOr<HomePlan> plan = PlanNsHomes(specs, DomainSize{l.G, l.T});
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<NsHome> homes = plan->homes;
  for (size_t i = 0; i < homes.size(); ++i) homes[i].d = int(i + 1) % l.D;
  return homes;
}

}  // namespace muond::testing_layouts
