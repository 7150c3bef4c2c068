// Lane NS and lane slabs with odd groups on a device-like backend (one
// lane): an empty Muon group, an AdamW group between Muon
// groups, a group whose every param is skipped, groups of two precisions,
// measured and unmeasured steps. Reference: the same groups each in an
// engine of its own on the CPU backend (no lane NS, no cross-group batch).
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

struct Spec {
  std::string name;
  Algorithm algorithm;
  bool medium;
  std::vector<std::pair<int64_t, int64_t>> shapes;
};

const std::vector<Spec>& Specs() {
  static const auto* specs = new std::vector<Spec>{
      {"a", Algorithm::kMuon, false, {{4, 6}, {6, 4}, {4, 6}}},
      {"empty", Algorithm::kMuon, false, {}},
      {"adam", Algorithm::kAdamW, false, {{4, 6}}},
      {"b", Algorithm::kMuon, true, {{4, 6}, {3, 3}}},
      {"c", Algorithm::kMuon, false, {{6, 4}, {4, 6}}},
      {"skipped", Algorithm::kMuon, false, {{4, 6}}},
      {"d", Algorithm::kMuon, true, {{4, 6}}},
  };
  return *specs;
}

float Value(int g, int p, int step, int64_t i) {
  return float((g * 31 + p * 17 + step * 13 + i * 7) % 97) / 97.0f - 0.5f;
}

class Engine {
 public:
  // `only`: the one spec this engine holds (-1: all).
  Engine(Backend* backend, int only) {
    std::vector<GroupConfig> groups;
    for (int g = 0; g < int(Specs().size()); ++g) {
      if (only >= 0 && g != only) continue;
      const Spec& s = Specs()[g];
      for (int p = 0; p < int(s.shapes.size()); ++p) {
        auto& v = values_[{g, p}];
        auto& gr = grads_[{g, p}];
        v.resize(s.shapes[p].first * s.shapes[p].second);
        gr.resize(v.size());
        for (size_t i = 0; i < v.size(); ++i) v[i] = Value(g, p, 0, i);
      }
    }
    for (int g = 0; g < int(Specs().size()); ++g) {
      if (only >= 0 && g != only) continue;
      const Spec& s = Specs()[g];
      GroupConfig& c = groups.emplace_back();
      c.name = s.name;
      if (s.name == "skipped") has_skipped_ = true;
      c.algorithm = s.algorithm;
      if (s.algorithm == Algorithm::kMuon) {
        c.muon.lr = 0.02;
        if (s.medium) c.muon.ns.precision = MatmulPrecision::kMedium;
      } else {
        c.adamw.lr = 0.01;
      }
      for (int p = 0; p < int(s.shapes.size()); ++p) {
        ParamBinding b;
        b.name = absl::StrCat(s.name, ".w", p);
        b.full_shape = {s.shapes[p].first, s.shapes[p].second};
        b.param = ContiguousView(values_[{g, p}].data(), DType::kFloat32,
                                 s.shapes[p].first, s.shapes[p].second);
        b.grad = ContiguousView(grads_[{g, p}].data(), DType::kFloat32,
                                s.shapes[p].first, s.shapes[p].second);
        c.params.push_back(b);
      }
    }
    StepOptions options;
    options.ns_shape_timing_every = 2;
    auto created = LayerShardedMuon::Create(backend, groups, options);
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) engine_ = std::move(*created);
  }
  absl::Status Step(int step) {
    for (auto& [key, g] : grads_) {
      for (size_t i = 0; i < g.size(); ++i) {
        g[i] = Value(key.first + 3, key.second, step, i);
      }
    }
    StepInputs in;
    if (has_skipped_) in.skip_params = {"skipped.w0"};
    return engine_->RunStep(in).status();
  }
  std::map<std::pair<int, int>, std::vector<float>> values_, grads_;
  bool has_skipped_ = false;
  std::unique_ptr<LayerShardedMuon> engine_;
};

TEST(LaneOddGroups, OddGroupsInOneLaneStepAsAlone) {
  testing::DeviceLikeCpuBackend device;
  Engine all(&device, -1);
  ASSERT_NE(all.engine_, nullptr);
  std::vector<std::unique_ptr<Backend>> cpus;
  std::vector<std::unique_ptr<Engine>> alone;
  for (int g = 0; g < int(Specs().size()); ++g) {
    cpus.push_back(MakeCpuBackend());
    alone.push_back(std::make_unique<Engine>(cpus.back().get(), g));
  }
  for (int step = 1; step <= 5; ++step) {
    const absl::Status st = all.Step(step);
    ASSERT_TRUE(st.ok()) << step << ": " << st;
    for (auto& e : alone) {
      const absl::Status one = e->Step(step);
      ASSERT_TRUE(one.ok()) << step << ": " << one;
    }
    for (int g = 0; g < int(Specs().size()); ++g) {
      for (auto& [key, v] : alone[g]->values_) {
        EXPECT_EQ(all.values_[key], v)
            << "step " << step << " group " << Specs()[g].name << " param "
            << key.second;
      }
    }
  }
}

}  // namespace
}  // namespace muond
