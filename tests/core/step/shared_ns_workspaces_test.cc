// The Muon groups of a lane share their Newton–Schulz engines and
// workspaces (NsRunner): a model registered as a group per layer holds the
// workspace of one layer, not one per layer. Groups whose NS options differ
// get engines of their own, and every group steps bitwise as it does in an
// engine of its own.
//
// The CPU backend plays a device, so that every group sits in one lane (as
// on a GPU: a device backend joins its groups in one lane).
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

using testing::DeviceLikeCpuBackend;

struct Shape {
  int64_t rows, cols;
};
// One layer's matrices: square, wide, tall (standard and Gram NS alike).
constexpr Shape kLayer[] = {{24, 24}, {12, 40}, {40, 12}};

float Value(int layer, int param, int step, int64_t i) {
  return float((layer * 53 + param * 131 + step * 37 + i * 7) % 101) / 101.0f -
         0.5f;
}

// `layers` groups of kLayer's matrices (group k: layer first_layer + k), on
// a backend of its own; `options_of(layer)` each group's Muon options.
class Layers {
 public:
  Layers(int first_layer, int layers, MuonOptions (*options_of)(int)) {
    std::vector<GroupConfig> groups;
    for (int l = first_layer; l < first_layer + layers; ++l) {
      GroupConfig g;
      g.name = absl::StrCat("layer ", l);
      g.muon = options_of(l);
      for (int p = 0; p < int(std::size(kLayer)); ++p) {
        const Shape s = kLayer[p];
        Param& param = params_.emplace_back(Param{l, p, {}, {}});
        param.value.resize(s.rows * s.cols);
        param.grad.resize(s.rows * s.cols);
        for (size_t i = 0; i < param.value.size(); ++i) {
          param.value[i] = Value(l, p, 0, int64_t(i));
        }
      }
      groups.push_back(std::move(g));
    }
    // Bind after params_ stops growing (the views point into it).
    size_t next = 0;
    for (GroupConfig& g : groups) {
      for (int p = 0; p < int(std::size(kLayer)); ++p, ++next) {
        Param& param = params_[next];
        const Shape s = kLayer[p];
        ParamBinding b;
        b.name = absl::StrCat(g.name, ".w", p);
        b.full_shape = {s.rows, s.cols};
        b.param =
            ContiguousView(param.value.data(), DType::kFloat32, s.rows, s.cols);
        b.grad =
            ContiguousView(param.grad.data(), DType::kFloat32, s.rows, s.cols);
        g.params.push_back(b);
      }
    }
    auto created = LayerShardedMuon::Create(&backend_, groups);
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) engine_ = std::move(*created);
  }

  void Step(int step) {
    for (Param& p : params_) {
      for (size_t i = 0; i < p.grad.size(); ++i) {
        p.grad[i] = Value(p.layer + 11, p.index, step, int64_t(i));
      }
    }
    auto result = engine_->Step({});
    ASSERT_TRUE(result.ok()) << result.status();
  }
  // Every param's values, layer by layer.
  std::vector<std::vector<float>> Values() const {
    std::vector<std::vector<float>> out;
    for (const Param& p : params_) out.push_back(p.value);
    return out;
  }
  LayerShardedMuon& engine() { return *engine_; }

 private:
  struct Param {
    int layer, index;
    std::vector<float> value, grad;
  };
  DeviceLikeCpuBackend backend_;
  std::vector<Param> params_;
  std::unique_ptr<LayerShardedMuon> engine_;
};

MuonOptions Batched(int) {
  MuonOptions o;
  o.lr = 0.02;
  o.ns_batch_size = 4;
  return o;
}

// Layers alternate standard and Gram NS, and 5 and 3 iterations.
MuonOptions Mixed(int layer) {
  MuonOptions o = Batched(layer);
  o.ns.algorithm = layer % 2 == 0 ? NsAlgorithm::kStandard : NsAlgorithm::kGram;
  o.ns.num_steps = layer % 3 == 0 ? 3 : 5;
  return o;
}

TEST(SharedNsWorkspaces, GroupsPerLayerHoldOneLayersWorkspace) {
  constexpr int kLayers = 24;
  Layers one(0, 1, Batched);
  Layers many(0, kLayers, Batched);
  one.Step(1);
  many.Step(1);
  ASSERT_GT(one.engine().ns_workspace_bytes(), 0);
  EXPECT_EQ(many.engine().ns_workspace_bytes(),
            one.engine().ns_workspace_bytes());
  EXPECT_EQ(many.engine().peak_ns_workspace_bytes(),
            one.engine().peak_ns_workspace_bytes());
}

TEST(SharedNsWorkspaces, GroupsOfOtherNsOptionsStepAsInEnginesOfTheirOwn) {
  constexpr int kLayers = 6;
  Layers shared(0, kLayers, Mixed);
  std::vector<std::unique_ptr<Layers>> alone;
  for (int l = 0; l < kLayers; ++l) {
    alone.push_back(std::make_unique<Layers>(l, 1, Mixed));
  }
  for (int step = 1; step <= 3; ++step) {
    shared.Step(step);
    for (auto& a : alone) a->Step(step);
  }
  const std::vector<std::vector<float>> got = shared.Values();
  size_t next = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (const std::vector<float>& want : alone[l]->Values()) {
      EXPECT_EQ(got[next], want) << "layer " << l << " param " << next;
      ++next;
    }
  }
  // Four (algorithm, iterations) pairs among the layers, each with its own
  // engines: more than one layer's workspace, fewer than six.
  int64_t alone_bytes = 0;
  for (auto& a : alone) alone_bytes += a->engine().ns_workspace_bytes();
  EXPECT_GT(shared.engine().ns_workspace_bytes(),
            alone[0]->engine().ns_workspace_bytes());
  EXPECT_LT(shared.engine().ns_workspace_bytes(), alone_bytes);
}

}  // namespace
}  // namespace muond
