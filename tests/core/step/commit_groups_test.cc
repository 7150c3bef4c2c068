// The commit of neighbouring Muon groups that commit alike (same backend,
// step options and momentum storage) as one: one batched update and one
// momentum store for them all (CommitMuonGroups). Six layer groups on a
// device-like backend in one lane, layer 3 with another lr and an AdamW
// group between layers 4 and 5, so the commit runs [0, 1, 2], [3], [4],
// AdamW, [5]: four update and four momentum-store calls a step, where one
// per group took six. Reference: every group in an engine of its own on
// the same kind of backend, bitwise.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

constexpr int kLayers = 6;
constexpr int kSteps = 3;
constexpr int kAdamAfter = 4;  // the AdamW group sits after this layer

// A device-like CPU backend counting the commit's batched calls.
class Counting final : public testing::DelegatingBackend {
 public:
  bool is_device() const override { return true; }
  absl::Status ApplyUpdateBatch(absl::Span<const MatrixView> params,
                                absl::Span<const MatrixView> updates,
                                absl::Span<const float> lrs, float decay,
                                WeightDecayMethod method) override {
    ++updates_applied;
    return Backend::ApplyUpdateBatch(params, updates, lrs, decay, method);
  }
  absl::Status MuonMomentumBatch(
      absl::Span<const MatrixView> grads,
      absl::Span<const MatrixView> momenta_in,
      absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
      absl::Span<const MatrixView> outs,
      absl::Span<const BlockScales> scales) override {
    ++momenta_stored;
    return Backend::MuonMomentumBatch(grads, momenta_in, momenta_out, beta,
                                      nesterov, outs, scales);
  }
  int updates_applied = 0;
  int momenta_stored = 0;
};

float Value(int group, int param, int step, int64_t i) {
  return float((group * 31 + param * 17 + step * 13 + i * 7) % 97) / 97.0f -
         0.5f;
}

// Groups 0..5 are the layers, group 6 the AdamW one.
constexpr int kGroups = kLayers + 1;

GroupConfig ConfigOf(int g,
                     std::map<std::pair<int, int>, std::vector<float>>& values,
                     std::map<std::pair<int, int>, std::vector<float>>& grads) {
  GroupConfig c;
  c.name = g == kLayers ? "adam" : absl::StrCat("layer", g);
  c.algorithm = g == kLayers ? Algorithm::kAdamW : Algorithm::kMuon;
  c.muon.lr = g == 3 ? 0.03 : 0.02;
  c.muon.ns_batch_size = 0;
  const std::pair<int64_t, int64_t> shapes[] = {{4, 6}, {6, 4}};
  for (int p = 0; p < 2; ++p) {
    const auto [rows, cols] = shapes[p];
    std::vector<float>& v = values[{g, p}];
    std::vector<float>& gr = grads[{g, p}];
    v.resize(rows * cols);
    gr.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = Value(g, p, 0, int64_t(i));
    ParamBinding b;
    b.name = absl::StrCat(c.name, ".w", p);
    b.full_shape = {rows, cols};
    b.param = ContiguousView(v.data(), DType::kFloat32, rows, cols);
    b.grad = ContiguousView(gr.data(), DType::kFloat32, rows, cols);
    c.params.push_back(b);
  }
  return c;
}

// The groups `order` in one engine, stepped kSteps times: every value.
std::map<std::pair<int, int>, std::vector<float>> StepGroups(
    Counting& backend, const std::vector<int>& order) {
  std::map<std::pair<int, int>, std::vector<float>> values, grads;
  std::vector<GroupConfig> configs;
  for (int g : order) configs.push_back(ConfigOf(g, values, grads));
  auto engine = LayerShardedMuon::Create(&backend, configs);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  for (int step = 1; step <= kSteps; ++step) {
    for (auto& [key, grad] : grads) {
      for (size_t i = 0; i < grad.size(); ++i) {
        grad[i] = Value(key.first, key.second, step, int64_t(i));
      }
    }
    const auto result = (*engine)->Step({});
    EXPECT_TRUE(result.ok()) << result.status();
  }
  return values;
}

TEST(CommitGroups, NeighboursThatCommitAlikeCommitAsOne) {
  std::vector<int> order;
  for (int g = 0; g < kLayers; ++g) {
    order.push_back(g);
    if (g == kAdamAfter) order.push_back(kLayers);
  }
  Counting backend;
  const auto together = StepGroups(backend, order);
  EXPECT_EQ(backend.updates_applied, 4 * kSteps);
  // Beside the commit's four stores, each group's momentum phase (in its
  // domain agreement, with the grad check) reaches the momentum kernel once.
  EXPECT_EQ(backend.momenta_stored, (kLayers + 4) * kSteps);
  for (int g = 0; g < kGroups; ++g) {
    SCOPED_TRACE(absl::StrCat("group ", g));
    Counting alone_backend;
    const auto alone = StepGroups(alone_backend, {g});
    for (int p = 0; p < 2; ++p) {
      EXPECT_EQ(together.at({g, p}), alone.at({g, p})) << "param " << p;
    }
  }
}

}  // namespace
}  // namespace muond
