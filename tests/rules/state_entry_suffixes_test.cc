// The daemons' state entry suffixes (the names LayerShardedMuon exports each
// param's state under, "<group>/<param>.<suffix>": core/step/engine_state.cc)
// against the shared table server_limits.json, which test_server_limits.py
// checks the client's copy (muond.state.TORCH_KEYS) against.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/backend/cpu_backend.h"
#include "core/common/matrix_view.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

// The suffixes of one group's exported entries, "<group>/w.<suffix>".
std::set<std::string> ExportedSuffixes(
    Algorithm algorithm, MuonVariant variant = MuonVariant::kMuon) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> param(4 * 4, 0.5f), grad(4 * 4, 0.25f);
  GroupConfig cfg;
  cfg.name = "g";
  cfg.algorithm = algorithm;
  cfg.muon.variant = variant;
  ParamBinding b;
  b.name = "w";
  b.full_shape = {4, 4};
  b.param = ContiguousView(param.data(), DType::kFloat32, 4, 4);
  b.grad = ContiguousView(grad.data(), DType::kFloat32, 4, 4);
  cfg.params.push_back(b);
  auto opt = LayerShardedMuon::Create(backend.get(), {cfg}, {});
  EXPECT_TRUE(opt.ok()) << opt.status();
  if (!opt.ok()) return {};
  auto state = (*opt)->ExportState();
  EXPECT_TRUE(state.ok()) << state.status();
  if (!state.ok()) return {};
  std::set<std::string> suffixes;
  const std::string prefix = "g/w.";
  for (const auto& [key, values] : *state) {
    EXPECT_EQ(key.rfind(prefix, 0), 0u) << key;
    suffixes.insert(key.substr(prefix.size()));
  }
  return suffixes;
}

std::set<std::string> TableSuffixes(const char* algorithm) {
  const nlohmann::json table = LoadCaseTable("server_limits.json");
  return table["state_entry_suffixes"][algorithm].get<std::set<std::string>>();
}

TEST(StateEntrySuffixesTest, Muon) {
  EXPECT_EQ(ExportedSuffixes(Algorithm::kMuon), TableSuffixes("muon"));
}

TEST(StateEntrySuffixesTest, MuonVariants) {
  EXPECT_EQ(ExportedSuffixes(Algorithm::kMuon, MuonVariant::kNorMuon),
            TableSuffixes("normuon"));
  EXPECT_EQ(ExportedSuffixes(Algorithm::kMuon, MuonVariant::kAdaMuon),
            TableSuffixes("adamuon"));
}

TEST(StateEntrySuffixesTest, AdamW) {
  EXPECT_EQ(ExportedSuffixes(Algorithm::kAdamW), TableSuffixes("adamw"));
}

}  // namespace
}  // namespace muond::rules
