// Manifest parsing, the shipped manifests (counts and shapes from the models'
// public configs: Llama 3 8B / 70B, Qwen3 1.7B / 30B-A3B), and `muonctl plan`
// end to end (JSON out).
#include "core/plan/manifest.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tools/muonctl/plan_command.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

TEST(ParseManifest, ListAndObjectForms) {
  absl::StatusOr<Manifest> m = ParseManifest(
      R"([{"name":"a","shape":[8,4],"tp_dim":0,"gtp_sharded":true},
          {"name":"b","shape":[4,8],"tp_dim":null,"pad_length":0}])");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->params.size(), 2u);
  EXPECT_EQ(m->params[0].tp_dim, 0);
  EXPECT_TRUE(m->params[0].gtp_sharded);
  EXPECT_EQ(m->params[0].pad_length, -1);
  EXPECT_EQ(m->params[1].tp_dim, -1);
  EXPECT_EQ(m->params[1].pad_length, 0);
  m = ParseManifest(R"({"model":"x","params":[{"name":"a","shape":[2,2]}]})");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->model, "x");
  absl::StatusOr<std::vector<ParamShardSpec>> specs =
      ManifestSpecs(*m, DomainSize{2, 2});
  ASSERT_TRUE(specs.ok());
  EXPECT_EQ((*specs)[0].sharding, ParamSharding::kReplicated);
}

TEST(ParseManifest, ErrorsNameTheEntry) {
  EXPECT_FALSE(ParseManifest("not json").ok());
  EXPECT_FALSE(ParseManifest(R"({"model":"x"})").ok());
  absl::StatusOr<Manifest> m =
      ParseManifest(R"([{"name":"w1","shape":[2,"x"]}])");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("'w1'"));
  m = ParseManifest(R"([{"name":"w2","shape":[2,2],"gtp_sharded":1}])");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("gtp_sharded"));
  m = ParseManifest(R"([{"shape":[2,2]}])");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("entry 0"));
}

struct Expect {
  const char* file;
  size_t count;
  std::vector<std::vector<int64_t>> shapes;  // the distinct full shapes
};

TEST(ShippedManifests, CountsAndShapes) {
  const std::vector<Expect> expect = {
      {"bench/manifests/llama3_8b.json",
       224,
       {{4096, 4096}, {1024, 4096}, {14336, 4096}, {4096, 14336}}},
      {"bench/manifests/llama3_70b.json",
       560,
       {{8192, 8192}, {1024, 8192}, {28672, 8192}, {8192, 28672}}},
      {"bench/manifests/qwen3_30b_a3b.json",
       18624,
       {{4096, 2048}, {512, 2048}, {2048, 4096}, {768, 2048}, {2048, 768}}},
  };
  for (const Expect& e : expect) {
    absl::StatusOr<Manifest> m = LoadManifestFile(e.file);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->params.size(), e.count) << e.file;
    std::vector<std::vector<int64_t>> seen;
    for (const ManifestParam& p : m->params)
      if (std::find(seen.begin(), seen.end(), p.shape) == seen.end())
        seen.push_back(p.shape);
    EXPECT_EQ(seen, e.shapes) << e.file;
    for (DomainSize d : {DomainSize{8, 1}, DomainSize{4, 2}, DomainSize{1, 8},
                         DomainSize{8, 8}}) {
      EXPECT_TRUE(ManifestSpecs(*m, d).ok()) << e.file;
    }
  }
}

TEST(MuonctlPlan, PrintsJsonPlan) {
  std::ostringstream out, err;
  const int rc =
      muonctl::RunPlan({"--manifest", "bench/manifests/llama3_8b.json",
                        "--gtp=4", "--tp", "2", "--cost", "flops"},
                       out, err);
  ASSERT_EQ(rc, 0) << err.str();
  nlohmann::json j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["homes"].size(), 224u);
  EXPECT_EQ(j["rank_load"].size(), 8u);
  EXPECT_EQ(j["domain"]["gtp"], 4);
  EXPECT_EQ(j["cost"], "flops");
  EXPECT_LE(j["max_over_mean"].get<double>(), 1.05);
  EXPECT_GE(j["lower_bound_ratio"].get<double>(), 1.0);
  EXPECT_EQ(j["homes"][0]["name"], "layers.0.self_attn.q_proj");
  EXPECT_EQ(j["homes"][0]["sharding"], "GTP_REMAT_AND_TP");
  // Independent check of the reported loads: sum of per-rank loads equals
  // the sum of the FLOP counts (every param is GTP_REMAT_AND_TP here).
  double total = 0, want = 0;
  for (const auto& l : j["rank_load"]) total += l.get<double>();
  for (const auto& h : j["homes"]) {
    const double m = std::min(h["full_shape"][0].get<double>(),
                              h["full_shape"][1].get<double>());
    const double n = std::max(h["full_shape"][0].get<double>(),
                              h["full_shape"][1].get<double>());
    want += 5 * (4 * m * m * n + 2 * m * m * m);
  }
  EXPECT_NEAR(total / want, 1.0, 1e-12);
}

TEST(MuonctlPlan, UsageAndErrors) {
  std::ostringstream out, err;
  EXPECT_EQ(muonctl::RunPlan({"--gtp", "2"}, out, err), 2);
  EXPECT_THAT(err.str(), HasSubstr("--manifest"));
  EXPECT_EQ(muonctl::RunPlan({"--manifest", "x", "--cost", "bogus"}, out, err),
            2);
  EXPECT_EQ(muonctl::RunPlan({"--manifest", "x", "--frobnicate"}, out, err), 2);
  err.str("");
  EXPECT_EQ(muonctl::RunPlan({"--manifest", "bench/manifests/llama3_8b.json",
                              "--gtp", "3", "--tp", "3"},
                             out, err),
            1);
  EXPECT_THAT(err.str(), HasSubstr("divisible by T=3"));
  err.str("");
  out.str("");
  EXPECT_EQ(muonctl::RunPlan({"--manifest", "bench/manifests/llama3_8b.json",
                              "--gtp", "2", "--tp", "1", "--round-robin"},
                             out, err),
            0);
  EXPECT_TRUE(nlohmann::json::parse(out.str())["round_robin_fallback"]);
}

}  // namespace
}  // namespace muond
