// Simulates every rank's all_to_allv in-process (no communicator): each rank
// packs by its plan, buffers are exchanged by the plan's counts, each rank
// unpacks. Checks against an independent reference sharding (plain loops):
// every NS home assembles exactly the full matrix, and the reverse route
// returns every shard of the update bit-exactly, pad rows zero.
#include "core/plan/exchange_plan.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/planner.h"
#include "core/plan/sharding.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  Mat() = default;
  Mat(int64_t r, int64_t c, double fill) : rows(r), cols(c), v(r * c, fill) {}
  double& at(int64_t i, int64_t j) { return v[i * cols + j]; }
  double at(int64_t i, int64_t j) const { return v[i * cols + j]; }
};

bool BitEqual(const Mat& a, const Mat& b) {
  return a.rows == b.rows && a.cols == b.cols &&
         std::memcmp(a.v.data(), b.v.data(), a.v.size() * sizeof(double)) == 0;
}

constexpr double kPadGarbage = -777.25;  // local pad rows: must never be sent
constexpr double kUnwritten = -999.5;    // destination not yet written

// ---- Reference sharding (independent of core/plan) -------------------------
struct Case {
  int64_t R, C;  // TP-local real shape
  int tp_dim;    // -1, 0, 1 (effective)
  bool gtp;      // effective
  int64_t pad;
  // Uneven GTP blocks of the padded R + pad rows, in g order; empty: equal.
  std::vector<int64_t> gtp_rows = {};
};

Mat FullOf(const Case& k, DomainSize d, std::mt19937_64& rng, int salt) {
  const int64_t P = k.tp_dim == 0 ? k.R * d.tp : k.R;
  const int64_t Q = k.tp_dim == 1 ? k.C * d.tp : k.C;
  Mat m(P, Q, 0);
  std::uniform_int_distribution<int> u(-1000000, 1000000);
  for (double& x : m.v) x = u(rng) * 0.001 + salt;
  return m;
}

// The TP-local matrix of TP rank t.
Mat TpLocalOf(const Mat& full, const Case& k, int t) {
  Mat m(k.R, k.C, 0);
  for (int64_t i = 0; i < k.R; ++i)
    for (int64_t j = 0; j < k.C; ++j)
      m.at(i, j) = full.at(k.tp_dim == 0 ? t * k.R + i : i,
                           k.tp_dim == 1 ? t * k.C + j : j);
  return m;
}

// The local shard of rank (g, t); pad rows hold `pad_value`.
Mat ShardOf(const Mat& full, const Case& k, DomainSize d, int g, int t,
            double pad_value) {
  const Mat tl = TpLocalOf(full, k, t);
  if (!k.gtp) return tl;
  int64_t r = (k.R + k.pad) / d.gtp, start = g * r;
  if (!k.gtp_rows.empty()) {
    r = k.gtp_rows[g];
    start = 0;
    for (int q = 0; q < g; ++q) start += k.gtp_rows[q];
  }
  Mat m(r, k.C, pad_value);
  for (int64_t i = 0; i < r; ++i) {
    const int64_t src = start + i;
    if (src >= k.R) continue;
    for (int64_t j = 0; j < k.C; ++j) m.at(i, j) = tl.at(src, j);
  }
  return m;
}

// The "NS": any fixed elementwise function, computed independently per home.
Mat Update(const Mat& m, int salt) {
  Mat u = m;
  for (double& x : u.v) x = -2 * x + salt;
  return u;
}

// ---- Simulation -------------------------------------------------------------
using Key = std::pair<int, int>;  // (flat rank, param)
using Store = std::map<Key, Mat>;

void Pack(const Store& src, int rank, const AllToAllvPlan& a2a,
          std::vector<double>& buf) {
  buf.assign(a2a.total_send, kUnwritten);
  int64_t counted = 0;
  for (size_t p = 0; p < a2a.send.size(); ++p) {
    counted += a2a.send_counts[p];
    int64_t off = a2a.send_displs[p];
    for (const Piece& piece : a2a.send[p]) {
      ASSERT_EQ(piece.offset, off) << "pieces must be packed back to back";
      const Mat& m = src.at({rank, piece.param});
      const Block& b = piece.block;
      ASSERT_LE(b.row0 + b.rows, m.rows);
      ASSERT_LE(b.col0 + b.cols, m.cols);
      for (int64_t i = 0; i < b.rows; ++i)
        for (int64_t j = 0; j < b.cols; ++j)
          buf[off++] = m.at(b.row0 + i, b.col0 + j);
    }
    ASSERT_EQ(off, a2a.send_displs[p] + a2a.send_counts[p]);
  }
  ASSERT_EQ(counted, a2a.total_send);
}

void Unpack(const std::vector<double>& buf, int rank, const AllToAllvPlan& a2a,
            Store& dst) {
  for (size_t p = 0; p < a2a.recv.size(); ++p) {
    int64_t off = a2a.recv_displs[p];
    for (const Piece& piece : a2a.recv[p]) {
      ASSERT_EQ(piece.offset, off);
      Mat& m = dst.at({rank, piece.param});
      const Block& b = piece.block;
      ASSERT_LE(b.row0 + b.rows, m.rows);
      ASSERT_LE(b.col0 + b.cols, m.cols);
      for (int64_t i = 0; i < b.rows; ++i)
        for (int64_t j = 0; j < b.cols; ++j)
          m.at(b.row0 + i, b.col0 + j) = buf[off++];
    }
    ASSERT_EQ(off, a2a.recv_displs[p] + a2a.recv_counts[p]);
  }
}

// One all_to_allv among `members` (flat ranks, peer order).
void AllToAllv(const std::vector<int>& members,
               const std::vector<const AllToAllvPlan*>& plans, const Store& src,
               Store& dst) {
  const size_t n = members.size();
  std::vector<std::vector<double>> send(n), recv(n);
  for (size_t q = 0; q < n; ++q) {
    ASSERT_EQ(plans[q]->send.size(), n);
    Pack(src, members[q], *plans[q], send[q]);
  }
  for (size_t p = 0; p < n; ++p) {
    recv[p].assign(plans[p]->total_recv, kUnwritten);
    for (size_t q = 0; q < n; ++q) {
      ASSERT_EQ(plans[q]->send_counts[p], plans[p]->recv_counts[q])
          << "count mismatch " << members[q] << " -> " << members[p];
      std::copy_n(send[q].begin() + plans[q]->send_displs[p],
                  plans[q]->send_counts[p],
                  recv[p].begin() + plans[p]->recv_displs[q]);
    }
  }
  for (size_t p = 0; p < n; ++p) Unpack(recv[p], members[p], *plans[p], dst);
}

// Runs forward and reverse for one group of `members` on `exchanges`.
struct Sim {
  DomainSize d;
  std::vector<ParamShardSpec> specs;
  std::vector<Case> cases;
  std::vector<Mat> full;
  std::vector<GroupExchangePlan> plans;  // by flat rank
  // Uneven GTP blocks: the specs of GTP rank g (local shapes differ by g).
  // Empty: `specs` on every rank.
  std::vector<std::vector<ParamShardSpec>> specs_of_g;
  const std::vector<ParamShardSpec>& SpecsOf(int g) const {
    return specs_of_g.empty() ? specs : specs_of_g[g];
  }
};

void RunAndCheck(const Sim& s) {
  const DomainSize d = s.d;
  const int n = int(s.specs.size());
  Store L, A1, A2, U2, U1, UL;
  for (int g = 0; g < d.gtp; ++g)
    for (int t = 0; t < d.tp; ++t)
      for (int i = 0; i < n; ++i)
        L[{d.FlatRank(g, t), i}] =
            ShardOf(s.full[i], s.cases[i], d, g, t, kPadGarbage);
  // Destinations the plan says each rank assembles.
  for (int r = 0; r < d.ranks(); ++r) {
    const GroupExchangePlan& p = s.plans[r];
    if (p.has_stage1)
      for (const AssembledParam& a : p.stage1.assembled) {
        A1[{r, a.param}] = Mat(a.rows, a.cols, kUnwritten);
        U1[{r, a.param}] = Mat(a.rows, a.cols, kUnwritten);
      }
    for (const StageExchange& ex : p.stage2)
      for (const AssembledParam& a : ex.assembled) {
        A2[{r, a.param}] = Mat(a.rows, a.cols, kUnwritten);
        U2[{r, a.param}] = Mat(a.rows, a.cols, kUnwritten);
      }
    for (int i : p.routed) {
      const ParamShardSpec& mine = s.SpecsOf(r / d.tp)[i];
      UL[{r, i}] = Mat(mine.local_shape[0], mine.local_shape[1], kUnwritten);
    }
  }
  // Stage-2 sources: A1 for GTP params, L itself for kTp params.
  auto stage2_source = [&](const Store& a1) {
    Store src = a1;
    for (const auto& [key, m] : L)
      if (s.specs[key.second].sharding == ParamSharding::kTp) src[key] = m;
    return src;
  };

  const bool stage1 = s.plans[0].has_stage1;
  const size_t num_stage2 = s.plans[0].stage2.size();
  for (const GroupExchangePlan& p : s.plans) {
    ASSERT_EQ(p.has_stage1, stage1);
    ASSERT_EQ(p.stage2.size(), num_stage2);
  }
  auto column = [&](int t) {
    std::vector<int> m;
    for (int g = 0; g < d.gtp; ++g) m.push_back(d.FlatRank(g, t));
    return m;
  };
  auto row = [&](int g) {
    std::vector<int> m;
    for (int t = 0; t < d.tp; ++t) m.push_back(d.FlatRank(g, t));
    return m;
  };
  auto run_stage1 = [&](bool forward, const Store& src, Store& dst) {
    for (int t = 0; t < d.tp; ++t) {
      std::vector<int> members = column(t);
      std::vector<const AllToAllvPlan*> a2a;
      for (int r : members) {
        EXPECT_EQ(s.plans[r].stage1.group_ranks, members);
        a2a.push_back(forward ? &s.plans[r].stage1.forward
                              : &s.plans[r].stage1.reverse);
      }
      AllToAllv(members, a2a, src, dst);
    }
  };
  auto run_stage2 = [&](size_t e, bool forward, const Store& src, Store& dst) {
    for (int g = 0; g < d.gtp; ++g) {
      std::vector<int> members = row(g);
      std::vector<const AllToAllvPlan*> a2a;
      bool active = s.plans[members[0]].stage2[e].active;
      for (int r : members) {
        const StageExchange& ex = s.plans[r].stage2[e];
        EXPECT_EQ(ex.group_ranks, members);
        EXPECT_EQ(ex.active, active) << "members must agree on skipping";
        a2a.push_back(forward ? &ex.forward : &ex.reverse);
        if (!active) {
          EXPECT_EQ(ex.forward.total_send + ex.forward.total_recv +
                        ex.reverse.total_send + ex.reverse.total_recv,
                    0);
        }
      }
      AllToAllv(members, a2a, src, dst);
    }
  };

  // ---- forward
  if (stage1) run_stage1(true, L, A1);
  for (size_t e = 0; e < num_stage2; ++e)
    run_stage2(e, true, stage2_source(A1), A2);

  // Every home assembled exactly the full matrix; every stage-1 assembly is
  // exactly the TP-local matrix of its column.
  for (const auto& [key, m] : A1) {
    const int t = key.first % d.tp;
    EXPECT_TRUE(
        BitEqual(m, TpLocalOf(s.full[key.second], s.cases[key.second], t)))
        << "stage-1 assembly of " << s.specs[key.second].name << " on rank "
        << key.first;
  }
  int ns_count = 0;
  for (int r = 0; r < d.ranks(); ++r) {
    const GroupExchangePlan& p = s.plans[r];
    for (int i : p.ns_after_stage2) {
      ++ns_count;
      EXPECT_TRUE(BitEqual(A2.at({r, i}), s.full[i]))
          << "full matrix of " << s.specs[i].name << " at rank " << r;
      U2[{r, i}] = Update(A2.at({r, i}), i);
    }
    for (int i : p.ns_tp_complete) {
      ++ns_count;
      EXPECT_TRUE(BitEqual(A1.at({r, i}), s.full[i]))
          << "TP-complete matrix of " << s.specs[i].name << " at rank " << r;
      U1[{r, i}] = Update(A1.at({r, i}), i);
    }
  }
  // Each TP-sharded routed param runs NS once; each GTP-only param T times.
  int expected_ns = 0;
  for (const ParamShardSpec& spec : s.specs) {
    if (spec.sharding == ParamSharding::kGtpRemat) expected_ns += d.tp;
    if (spec.tp_sharded()) expected_ns += 1;
  }
  EXPECT_EQ(ns_count, expected_ns);

  // ---- reverse
  Store U1_for_kTp;  // kTp params land directly in UL
  for (size_t e = 0; e < num_stage2; ++e) {
    Store dst = U1;
    for (const auto& [key, m] : UL)
      if (s.specs[key.second].sharding == ParamSharding::kTp) dst[key] = m;
    run_stage2(e, false, U2, dst);
    for (auto& [key, m] : dst) {
      if (s.specs[key.second].sharding == ParamSharding::kTp) {
        if (s.specs[key.second].tp_dim == s.plans[0].stage2[e].tp_dim)
          UL[key] = m;
      } else if (U1.count(key)) {
        U1[key] = m;
      }
    }
  }
  if (stage1) {
    run_stage1(false, U1, UL);
    for (int r = 0; r < d.ranks(); ++r)
      for (const ZeroFill& z : s.plans[r].stage1.reverse_zero_fill) {
        Mat& m = UL.at({r, z.param});
        for (int64_t i = 0; i < z.block.rows; ++i)
          for (int64_t j = 0; j < z.block.cols; ++j)
            m.at(z.block.row0 + i, z.block.col0 + j) = 0.0;
      }
  }
  for (int g = 0; g < d.gtp; ++g)
    for (int t = 0; t < d.tp; ++t)
      for (int i = 0; i < n; ++i) {
        if (!s.specs[i].routed()) continue;
        const int r = d.FlatRank(g, t);
        const Mat expected =
            ShardOf(Update(s.full[i], i), s.cases[i], d, g, t, 0.0);
        EXPECT_TRUE(BitEqual(UL.at({r, i}), expected))
            << "update shard of " << s.specs[i].name << " at (" << g << ", "
            << t << ")";
      }
}

// Random params valid for domain d.
Sim RandomSim(DomainSize d, std::mt19937_64& rng, int num_params) {
  Sim s;
  s.d = d;
  std::uniform_int_distribution<int> coin(0, 1), small(1, 4), tpdim(-1, 1);
  for (int i = 0; i < num_params; ++i) {
    ShardTags tags;
    const int tp_dim = d.tp > 1 ? tpdim(rng) : -1;
    tags.tensor_model_parallel = tp_dim >= 0 || coin(rng);
    tags.partition_dim = tp_dim;
    // TP-sharded params must be GTP-sharded when G > 1.
    tags.is_gtp_weight_remat = (tp_dim >= 0 && d.gtp > 1) || coin(rng);
    const bool gtp = d.gtp > 1 && tags.is_gtp_weight_remat;
    const int64_t r = small(rng), c = small(rng);
    if (gtp) {
      // Any pad that leaves at least one real row; pad >= r gives ranks that
      // hold nothing but padding.
      tags.pad_length =
          std::uniform_int_distribution<int64_t>(0, r * d.gtp - 1)(rng);
      if (coin(rng)) tags.pad_length = std::min<int64_t>(tags.pad_length, 1);
    }
    absl::StatusOr<ParamShardSpec> spec =
        MakeShardSpec("p" + std::to_string(i), {r, c}, tags, d);
    EXPECT_TRUE(spec.ok()) << spec.status();
    s.specs.push_back(*spec);
    Case k{gtp ? r * d.gtp - tags.pad_length : r, c, tp_dim, gtp,
           tags.pad_length};
    s.cases.push_back(k);
    s.full.push_back(FullOf(k, d, rng, i));
  }
  return s;
}

std::vector<NsHome> RandomHomes(const Sim& s, std::mt19937_64& rng) {
  std::vector<NsHome> homes;
  for (size_t i = 0; i < s.specs.size(); ++i) {
    homes.push_back(
        NsHome{std::uniform_int_distribution<int>(0, s.d.gtp - 1)(rng),
               std::uniform_int_distribution<int>(0, s.d.tp - 1)(rng)});
  }
  return homes;
}

void BuildPlans(Sim& s, const std::vector<NsHome>& homes) {
  s.plans.clear();
  for (int g = 0; g < s.d.gtp; ++g)
    for (int t = 0; t < s.d.tp; ++t) {
      absl::StatusOr<GroupExchangePlan> p =
          BuildGroupExchangePlan(s.SpecsOf(g), homes, s.d, g, t);
      ASSERT_TRUE(p.ok()) << p.status();
      s.plans.push_back(*std::move(p));
    }
}

TEST(ExchangePlanSimulation, RandomShapesHomesPaddingAllDomainsUpTo4x4) {
  std::mt19937_64 rng(20240603);
  int cases = 0;
  for (int G = 1; G <= 4; ++G)
    for (int T = 1; T <= 4; ++T)
      for (int trial = 0; trial < 12; ++trial) {
        SCOPED_TRACE(testing::Message()
                     << "G=" << G << " T=" << T << " trial=" << trial);
        Sim s = RandomSim(DomainSize{G, T}, rng,
                          std::uniform_int_distribution<int>(1, 10)(rng));
        BuildPlans(s, RandomHomes(s, rng));
        RunAndCheck(s);
        ++cases;
      }
  EXPECT_EQ(cases, 192);
}

TEST(ExchangePlanSimulation, PlannerHomes) {
  std::mt19937_64 rng(7);
  for (auto [G, T] : std::vector<std::pair<int, int>>{
           {2, 2}, {4, 1}, {1, 4}, {4, 4}, {3, 2}}) {
    SCOPED_TRACE(testing::Message() << "G=" << G << " T=" << T);
    Sim s = RandomSim(DomainSize{G, T}, rng, 16);
    absl::StatusOr<HomePlan> plan = PlanNsHomes(s.specs, s.d);
    ASSERT_TRUE(plan.ok()) << plan.status();
    BuildPlans(s, plan->homes);
    RunAndCheck(s);
  }
}

TEST(ExchangePlanSimulation, AllHomedOnOneRankLeavesOthersIdle) {
  std::mt19937_64 rng(11);
  Sim s = RandomSim(DomainSize{4, 4}, rng, 9);
  std::vector<NsHome> homes(s.specs.size(), NsHome{3, 2});
  BuildPlans(s, homes);
  RunAndCheck(s);
  // Rank (0, 0) assembles nothing in stage 2 and receives nothing back there.
  const GroupExchangePlan& idle = s.plans[0];
  for (const StageExchange& ex : idle.stage2) {
    EXPECT_EQ(ex.forward.total_recv, 0);
    EXPECT_FALSE(ex.active) << "row 0 has no TP-sharded home";
  }
  EXPECT_TRUE(idle.ns_after_stage2.empty());
  EXPECT_TRUE(idle.ns_tp_complete.empty());
}

TEST(ExchangePlan, KnownTwoByTwoLayout) {
  // Column-parallel 8x6 weight, G=2 x T=2, pad 1: TP-local 4x6 -> padded 5?
  // No: choose TP-local 3 rows + pad 1 = 4 = 2 x 2 local rows.
  const DomainSize d{2, 2};
  ShardTags tags{true, 0, true, 1};
  absl::StatusOr<ParamShardSpec> spec = MakeShardSpec("w", {2, 6}, tags, d);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->full_shape, (std::vector<int64_t>{6, 6}));
  // Home (1, 1).
  absl::StatusOr<GroupExchangePlan> p10 =
      BuildGroupExchangePlan({*spec}, {NsHome{1, 1}}, d, 1, 0);
  ASSERT_TRUE(p10.ok()) << p10.status();
  // Rank (1, 0): local rows 2..3 of TP-local 3 rows -> 1 real row, 1 pad.
  const StageExchange& s1 = p10->stage1;
  EXPECT_EQ(s1.group_ranks, (std::vector<int>{0, 2}));
  EXPECT_EQ(s1.forward.send_counts, (std::vector<int64_t>{0, 6}));
  EXPECT_EQ(s1.forward.recv_counts, (std::vector<int64_t>{12, 6}));
  EXPECT_EQ(s1.forward.recv[0][0].block, (Block{0, 0, 2, 6}));
  EXPECT_EQ(s1.forward.recv[1][0].block, (Block{2, 0, 1, 6}));
  ASSERT_EQ(s1.assembled.size(), 1u);
  EXPECT_EQ(s1.assembled[0].rows, 3);
  ASSERT_EQ(s1.reverse_zero_fill.size(), 1u);
  EXPECT_EQ(s1.reverse_zero_fill[0].block, (Block{1, 0, 1, 6}));
  ASSERT_EQ(p10->stage2.size(), 1u);
  EXPECT_EQ(p10->stage2[0].forward.send_counts, (std::vector<int64_t>{0, 18}));
  EXPECT_TRUE(p10->ns_after_stage2.empty());
  absl::StatusOr<GroupExchangePlan> p11 =
      BuildGroupExchangePlan({*spec}, {NsHome{1, 1}}, d, 1, 1);
  ASSERT_TRUE(p11.ok());
  EXPECT_EQ(p11->ns_after_stage2, (std::vector<int>{0}));
  EXPECT_EQ(p11->stage2[0].forward.recv[0][0].block, (Block{0, 0, 3, 6}));
  EXPECT_EQ(p11->stage2[0].forward.recv[1][0].block, (Block{3, 0, 3, 6}));
  EXPECT_EQ(p11->stage2[0].forward.recv[1][0].offset, 18);
  EXPECT_EQ(p11->max_recv_elems, 36);
}

TEST(ExchangePlan, RowParallelStage2UsesColumnBlocks) {
  const DomainSize d{1, 2};
  ShardTags tags{true, 1, false, 0};
  absl::StatusOr<ParamShardSpec> spec = MakeShardSpec("o", {4, 3}, tags, d);
  ASSERT_TRUE(spec.ok());
  EXPECT_EQ(spec->sharding, ParamSharding::kTp);
  absl::StatusOr<GroupExchangePlan> p =
      BuildGroupExchangePlan({*spec}, {NsHome{0, 0}}, d, 0, 0);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->has_stage1);
  ASSERT_EQ(p->stage2.size(), 1u);
  EXPECT_EQ(p->stage2[0].tp_dim, 1);
  EXPECT_EQ(p->stage2[0].forward.recv[1][0].block, (Block{0, 3, 4, 3}));
}

TEST(ExchangePlan, ReplicatedParamsAreNotRouted) {
  const DomainSize d{2, 2};
  absl::StatusOr<ParamShardSpec> spec =
      MakeShardSpec("r", {4, 4}, ShardTags{}, d);
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<GroupExchangePlan> p =
      BuildGroupExchangePlan({*spec}, {NsHome{1, 1}}, d, 0, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->replicated, (std::vector<int>{0}));
  EXPECT_TRUE(p->routed.empty());
  EXPECT_FALSE(p->has_stage1);
  EXPECT_TRUE(p->stage2.empty());
  EXPECT_EQ(p->max_send_elems, 0);
}

TEST(ExchangePlan, Errors) {
  const DomainSize d{2, 2};
  absl::StatusOr<ParamShardSpec> spec =
      MakeShardSpec("layer.qkv", {4, 4}, ShardTags{true, 0, true, 0}, d);
  ASSERT_TRUE(spec.ok());
  absl::StatusOr<GroupExchangePlan> p =
      BuildGroupExchangePlan({*spec}, {NsHome{2, 0}}, d, 0, 0);
  EXPECT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("layer.qkv"), std::string::npos);
  EXPECT_FALSE(BuildGroupExchangePlan({*spec}, {}, d, 0, 0).ok());
  EXPECT_FALSE(BuildGroupExchangePlan({*spec}, {NsHome{}}, d, 0, 2).ok());
  ParamShardSpec bad = *spec;
  bad.full_shape = {9, 8};
  p = BuildGroupExchangePlan({bad}, {NsHome{}}, d, 0, 0);
  EXPECT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("layer.qkv"), std::string::npos);
}

// ---- Uneven GTP row blocks (FSDP2's torch.chunk shards) ---------------------
// An uneven param: TP-local real rows R, cols C, pad, and the blocks.
struct UnevenParam {
  int64_t R, C;
  int tp_dim;  // effective
  int64_t pad;
  std::vector<int64_t> gtp_rows;
};

// Specs built per GTP rank from that rank's local shape (what each daemon
// does), and the reference cases.
Sim UnevenSim(DomainSize d, const std::vector<UnevenParam>& params,
              std::mt19937_64& rng) {
  Sim s;
  s.d = d;
  s.specs_of_g.resize(d.gtp);
  for (size_t i = 0; i < params.size(); ++i) {
    const UnevenParam& u = params[i];
    ShardTags tags;
    tags.tensor_model_parallel = u.tp_dim >= 0;
    tags.partition_dim = u.tp_dim;
    tags.is_gtp_weight_remat = true;
    tags.pad_length = u.pad;
    tags.gtp_rows = u.gtp_rows;
    for (int g = 0; g < d.gtp; ++g) {
      absl::StatusOr<ParamShardSpec> spec = MakeShardSpec(
          "u" + std::to_string(i), {u.gtp_rows[g], u.C}, tags, d, g);
      EXPECT_TRUE(spec.ok()) << spec.status();
      s.specs_of_g[g].push_back(*spec);
    }
    s.specs.push_back(s.specs_of_g[0].back());
    const Case k{u.R, u.C, u.tp_dim, true, u.pad, u.gtp_rows};
    s.cases.push_back(k);
    s.full.push_back(FullOf(k, d, rng, int(i)));
  }
  return s;
}

// torch.chunk's split of n rows into G pieces: ceil(n / G) each, the last
// ones short or empty.
std::vector<int64_t> TorchChunk(int64_t n, int G) {
  const int64_t each = (n + G - 1) / G;
  std::vector<int64_t> rows;
  for (int g = 0; g < G; ++g) {
    rows.push_back(std::clamp<int64_t>(n - g * each, 0, each));
  }
  return rows;
}

TEST(ExchangePlanSimulation, UnevenTorchChunkBlocksEveryHome) {
  EXPECT_EQ(TorchChunk(38, 2), (std::vector<int64_t>{19, 19}));
  EXPECT_EQ(TorchChunk(37, 2), (std::vector<int64_t>{19, 18}));
  EXPECT_EQ(TorchChunk(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  std::mt19937_64 rng(38);
  for (auto [G, T] :
       std::vector<std::pair<int, int>>{{2, 1}, {4, 1}, {2, 2}, {4, 2}}) {
    const std::vector<UnevenParam> params = {
        {38, 5, -1, 0, TorchChunk(38, G)},
        {37, 3, -1, 0, TorchChunk(37, G)},
        {3, 4, -1, 0, TorchChunk(3, G)},
        {37, 2, T > 1 ? 0 : -1, 0, TorchChunk(37, G)},  // column-parallel
        {5, 3, T > 1 ? 1 : -1, 0, TorchChunk(5, G)},    // row-parallel
        // Megatron's pad with uneven blocks: 5 real rows + 3 pad rows.
        {5, 2, T > 1 ? 0 : -1, 3, TorchChunk(8, G)},
    };
    for (int g = 0; g < G; ++g) {
      for (int t = 0; t < T; ++t) {
        SCOPED_TRACE(testing::Message() << "G=" << G << " T=" << T << " home ("
                                        << g << ", " << t << ")");
        Sim s = UnevenSim(DomainSize{G, T}, params, rng);
        BuildPlans(s, std::vector<NsHome>(params.size(), NsHome{g, t}));
        RunAndCheck(s);
      }
    }
  }
}

TEST(ExchangePlanSimulation, RandomUnevenBlocksWithEmptyShardsAndPadding) {
  std::mt19937_64 rng(19);
  for (int G = 2; G <= 4; ++G)
    for (int T = 1; T <= 3; ++T)
      for (int trial = 0; trial < 8; ++trial) {
        SCOPED_TRACE(testing::Message()
                     << "G=" << G << " T=" << T << " trial=" << trial);
        std::uniform_int_distribution<int> small(1, 6), tpdim(-1, 1), pad(0, 2);
        std::vector<UnevenParam> params;
        for (int i = 0; i < 6; ++i) {
          UnevenParam u{
              small(rng), small(rng), T > 1 ? tpdim(rng) : -1, pad(rng), {}};
          // A random composition of R + pad into G blocks, zeros allowed.
          std::vector<int64_t> cuts = {0, u.R + u.pad};
          for (int g = 1; g < G; ++g)
            cuts.push_back(
                std::uniform_int_distribution<int64_t>(0, u.R + u.pad)(rng));
          std::sort(cuts.begin(), cuts.end());
          for (int g = 0; g < G; ++g)
            u.gtp_rows.push_back(cuts[g + 1] - cuts[g]);
          params.push_back(u);
        }
        Sim s = UnevenSim(DomainSize{G, T}, params, rng);
        BuildPlans(s, RandomHomes(s, rng));
        RunAndCheck(s);
      }
}

// 3 rows over G = 4 (1, 1, 1, 0): the empty rank sends and receives no
// piece for it, its home included, and has nothing to zero-fill.
TEST(ExchangePlan, EmptyShardMovesNothing) {
  const DomainSize d{4, 1};
  ShardTags tags;
  tags.is_gtp_weight_remat = true;
  tags.gtp_rows = {1, 1, 1, 0};
  absl::StatusOr<ParamShardSpec> empty = MakeShardSpec("w", {0, 6}, tags, d, 3);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->full_shape, (std::vector<int64_t>{3, 6}));
  absl::StatusOr<GroupExchangePlan> p =
      BuildGroupExchangePlan({*empty}, {NsHome{0, 0}}, d, 3, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->stage1.forward.total_send, 0);
  EXPECT_EQ(p->stage1.reverse.total_recv, 0);
  EXPECT_TRUE(p->stage1.reverse_zero_fill.empty());
  EXPECT_TRUE(p->stage1.active);  // the others still exchange
  // The home (g = 3, the empty rank) receives rows 0, 1, 2 from g = 0, 1, 2.
  p = BuildGroupExchangePlan({*empty}, {NsHome{3, 0}}, d, 3, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->stage1.assembled.size(), 1u);
  EXPECT_EQ(p->stage1.assembled[0].rows, 3);
  for (int g = 0; g < 3; ++g) {
    ASSERT_EQ(p->stage1.forward.recv[g].size(), 1u);
    EXPECT_EQ(p->stage1.forward.recv[g][0].block, (Block{g, 0, 1, 6}));
  }
  EXPECT_TRUE(p->stage1.forward.recv[3].empty());
  // A rank's spec must be its own block: the g = 3 spec on rank 0 is refused.
  p = BuildGroupExchangePlan({*empty}, {NsHome{0, 0}}, d, 0, 0);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("gtp_rows[0]"), std::string::npos)
      << p.status();
}

}  // namespace
}  // namespace muond
