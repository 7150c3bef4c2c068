// The Muon groups of a lane share their Newton–Schulz engines and
// workspaces (NsRunner), and their NS runs batched across them (lane_ns.h):
// a model registered as a group per layer runs NS as one group of all its
// layers, with that group's workspace (not one per layer). Groups whose NS
// options differ get engines and batches of their own, and every group
// steps bitwise as it does in an engine of its own.
//
// The CPU backend plays a device, so that every group sits in one lane (as
// on a GPU: a device backend joins its groups in one lane).
#include <gtest/gtest.h>

#include <algorithm>
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

int GroupPerLayer(int layer) { return layer; }
int OneGroup(int) { return 0; }

// `layers` layers of kLayer's matrices (layers first_layer, first_layer + 1,
// ...) on a backend of their own, layer l in group `group_of(l)` (groups in
// order of their first layer); `options_of(layer)` its group's Muon options
// (the first layer's).
class Layers {
 public:
  Layers(int first_layer, int layers, MuonOptions (*options_of)(int),
         int (*group_of)(int) = GroupPerLayer) {
    std::vector<GroupConfig> groups;
    std::vector<int> group_ids;
    std::vector<size_t> group_of_layer;
    for (int l = first_layer; l < first_layer + layers; ++l) {
      const auto known =
          std::find(group_ids.begin(), group_ids.end(), group_of(l));
      group_of_layer.push_back(known - group_ids.begin());
      if (known != group_ids.end()) continue;
      group_ids.push_back(group_of(l));
      GroupConfig& g = groups.emplace_back();
      g.name = absl::StrCat("group ", group_of(l));
      g.muon = options_of(l);
    }
    for (int l = first_layer; l < first_layer + layers; ++l) {
      for (int p = 0; p < int(std::size(kLayer)); ++p) {
        const Shape s = kLayer[p];
        Param& param = params_.emplace_back(Param{l, p, {}, {}});
        param.value.resize(s.rows * s.cols);
        param.grad.resize(s.rows * s.cols);
        for (size_t i = 0; i < param.value.size(); ++i) {
          param.value[i] = Value(l, p, 0, int64_t(i));
        }
      }
    }
    // Bind after params_ stops growing (the views point into it).
    size_t next = 0;
    for (int l = first_layer; l < first_layer + layers; ++l) {
      GroupConfig& g = groups[group_of_layer[l - first_layer]];
      for (int p = 0; p < int(std::size(kLayer)); ++p, ++next) {
        Param& param = params_[next];
        const Shape s = kLayer[p];
        ParamBinding b;
        b.name = absl::StrCat("layer ", l, ".w", p);
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

// The bytes of the staging copies a batch of `batch` of each of kLayer's
// shapes takes from the budget (NsRunner::FitBatch) where its matrices do
// not lie back to back.
// The runner's one staging buffer for batches of `batch`: the largest
// shape's.
int64_t StagingBytes(int64_t batch) {
  int64_t bytes = 0;
  for (const Shape& s : kLayer) {
    bytes = std::max(bytes, batch * s.rows * s.cols * 4);
  }
  return bytes;
}

// A group per layer runs NS as one group of all the layers does (the lane
// batches across its groups, on L_i back to back in the lane's slabs):
// bitwise the same params and that group's workspace, with no staging; far
// less than a layer's workspace per layer.
TEST(SharedNsWorkspaces, GroupsPerLayerRunAsOneGroupOfAllLayers) {
  constexpr int kLayers = 24;
  Layers one(0, 1, Batched);
  Layers per_layer(0, kLayers, Batched);
  Layers one_group(0, kLayers, Batched, OneGroup);
  for (int step = 1; step <= 3; ++step) {  // step 1 measures NS per shape
    one.Step(step);
    per_layer.Step(step);
    one_group.Step(step);
    EXPECT_EQ(per_layer.Values(), one_group.Values()) << step;
  }
  const int64_t whole = one_group.engine().ns_workspace_bytes();
  ASSERT_GT(one.engine().ns_workspace_bytes(), 0);
  EXPECT_EQ(per_layer.engine().ns_workspace_bytes(), whole);
  EXPECT_EQ(per_layer.engine().peak_ns_workspace_bytes(),
            per_layer.engine().ns_workspace_bytes());
  EXPECT_LT(per_layer.engine().ns_workspace_bytes(),
            kLayers * one.engine().ns_workspace_bytes() / 4);
}

// Mixed's four (algorithm, iterations) pairs, one id each.
int OptionsClass(int layer) { return 2 * (layer % 2) + (layer % 3 == 0); }

// Groups whose NS options differ batch apart: a group per layer of mixed
// options steps bitwise as each layer in an engine of its own and as the
// layers grouped by options, and holds the workspace of the latter but for
// the staging of the batches whose layers are not neighbours (their L_i are
// not back to back).
TEST(SharedNsWorkspaces, GroupsOfOtherNsOptionsStepAsInEnginesOfTheirOwn) {
  constexpr int kLayers = 6;
  Layers shared(0, kLayers, Mixed);
  Layers by_options(0, kLayers, Mixed, OptionsClass);
  std::vector<std::unique_ptr<Layers>> alone;
  for (int l = 0; l < kLayers; ++l) {
    alone.push_back(std::make_unique<Layers>(l, 1, Mixed));
  }
  for (int step = 1; step <= 3; ++step) {
    shared.Step(step);
    by_options.Step(step);
    for (auto& a : alone) a->Step(step);
  }
  const std::vector<std::vector<float>> got = shared.Values();
  EXPECT_EQ(got, by_options.Values());
  size_t next = 0;
  for (int l = 0; l < kLayers; ++l) {
    for (const std::vector<float>& want : alone[l]->Values()) {
      EXPECT_EQ(got[next], want) << "layer " << l << " param " << next;
      ++next;
    }
  }
  // Two of the four classes hold two layers each (2 and 4, 1 and 5): their
  // batches of two are staged, through the runner's one staging buffer.
  EXPECT_EQ(shared.engine().ns_workspace_bytes(),
            by_options.engine().ns_workspace_bytes() + StagingBytes(2));
  EXPECT_GT(shared.engine().ns_workspace_bytes(),
            alone[0]->engine().ns_workspace_bytes());
}

}  // namespace
}  // namespace muond
