// Per-shape NS timings of LayerShardedMuon (StepResult::ns_shapes), the
// input of the coordinator's measured rebalancing: one rank, 1x1 domains (no
// communicators), CPU backend. Expected shapes and counts are the known
// param lists; times must be present, finite and non-negative (no timed
// assertions beyond that).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <utility>
#include <vector>

#include "core/backend/cpu_backend.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {
namespace {

struct Held {
  std::vector<float> param, grad;
};

struct Engine {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<std::unique_ptr<Held>> held;
  std::vector<GroupConfig> groups;

  // Adds a group of full `shapes` in a 1x1 domain (every param replicated:
  // this rank runs NS on each).
  void AddGroup(const std::string& name, Algorithm algorithm,
                const std::vector<std::pair<int64_t, int64_t>>& shapes,
                int64_t ns_batch_size = 1) {
    GroupConfig g;
    g.name = name;
    g.algorithm = algorithm;
    g.muon.ns_batch_size = ns_batch_size;
    g.domain.size = DomainSize{1, 1};
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto [rows, cols] = shapes[i];
      auto h = std::make_unique<Held>();
      h->param.assign(rows * cols, 0.5f);
      h->grad.resize(rows * cols);
      for (size_t k = 0; k < h->grad.size(); ++k) {
        h->grad[k] = float(int(k * 7 + i) % 13) / 13.0f - 0.5f;
      }
      ParamBinding b;
      b.name = name + "_" + std::to_string(i);
      b.full_shape = {rows, cols};
      b.param = ContiguousView(h->param.data(), DType::kFloat32, rows, cols);
      b.grad = ContiguousView(h->grad.data(), DType::kFloat32, rows, cols);
      g.params.push_back(b);
      held.push_back(std::move(h));
    }
    groups.push_back(std::move(g));
  }

  std::unique_ptr<LayerShardedMuon> Create(StepOptions options = {}) {
    auto opt = LayerShardedMuon::Create(backend.get(), groups, options);
    EXPECT_TRUE(opt.ok()) << opt.status();
    return opt.ok() ? *std::move(opt) : nullptr;
  }
};

// shape -> count, checking every entry's time.
std::map<std::pair<int64_t, int64_t>, int64_t> Counts(
    const std::vector<ShapeTiming>& timings) {
  std::map<std::pair<int64_t, int64_t>, int64_t> out;
  for (const ShapeTiming& t : timings) {
    EXPECT_TRUE(std::isfinite(t.ns_us) && t.ns_us >= 0) << t.ns_us;
    EXPECT_TRUE(out.emplace(std::make_pair(t.rows, t.cols), t.count).second)
        << "shape " << t.rows << "x" << t.cols << " listed twice";
  }
  return out;
}

TEST(NsShapeTiming, CountsEveryNsRunByShapeAcrossGroups) {
  Engine s;
  s.AddGroup("a", Algorithm::kMuon, {{8, 4}, {6, 10}, {8, 4}});
  s.AddGroup("b", Algorithm::kMuon, {{8, 4}, {1, 12}});
  s.AddGroup("adam", Algorithm::kAdamW, {{4, 4}, {1, 16}});  // no NS
  auto opt = s.Create();
  ASSERT_NE(opt, nullptr);
  const std::map<std::pair<int64_t, int64_t>, int64_t> want = {
      {{1, 12}, 1}, {{6, 10}, 1}, {{8, 4}, 3}};
  for (int step = 0; step < 2; ++step) {
    absl::StatusOr<StepResult> r = opt->Step({});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(Counts(r->ns_shapes), want) << "step " << step;
    // Ascending by shape.
    for (size_t i = 1; i < r->ns_shapes.size(); ++i) {
      EXPECT_LT(
          std::make_pair(r->ns_shapes[i - 1].rows, r->ns_shapes[i - 1].cols),
          std::make_pair(r->ns_shapes[i].rows, r->ns_shapes[i].cols));
    }
  }
}

TEST(NsShapeTiming, BatchedChunksCountEveryMatrix) {
  Engine s;
  s.AddGroup("a", Algorithm::kMuon, {{8, 4}, {8, 4}, {8, 4}, {6, 10}},
             /*ns_batch_size=*/2);
  auto opt = s.Create();
  ASSERT_NE(opt, nullptr);
  absl::StatusOr<StepResult> r = opt->Step({});
  ASSERT_TRUE(r.ok()) << r.status();
  const std::map<std::pair<int64_t, int64_t>, int64_t> want = {{{6, 10}, 1},
                                                               {{8, 4}, 3}};
  EXPECT_EQ(Counts(r->ns_shapes), want);
}

TEST(NsShapeTiming, OffWhenEveryIsZeroAndEmptyWithoutMuon) {
  Engine off;
  off.AddGroup("a", Algorithm::kMuon, {{8, 4}});
  StepOptions options;
  options.ns_shape_timing_every = 0;
  auto opt = off.Create(options);
  ASSERT_NE(opt, nullptr);
  absl::StatusOr<StepResult> r = opt->Step({});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ns_shapes.empty());

  Engine adam;
  adam.AddGroup("adam", Algorithm::kAdamW, {{4, 4}});
  auto opt2 = adam.Create();
  ASSERT_NE(opt2, nullptr);
  r = opt2->Step({});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->ns_shapes.empty());
}

}  // namespace
}  // namespace muond
