// core/plan's sharding rules against the shared table of cases
// (sharding_cases.json) that tests/client/python/test_split.py checks the
// Python client's copies (muond.split) against: the two languages agree
// because both match the same hand-written values.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "core/plan/sharding.h"
#include "nlohmann/json.hpp"

namespace muond {
namespace {

nlohmann::json LoadCases() {
  std::ifstream in("tests/core/plan/sharding_cases.json");
  EXPECT_TRUE(in.good()) << "sharding_cases.json not in the runfiles";
  return nlohmann::json::parse(in);
}

TEST(ShardingCasesTest, FullShapeFromLocalShapeAndTags) {
  const nlohmann::json cases = LoadCases()["full_shape_from_local"];
  ASSERT_FALSE(cases.empty());
  for (const nlohmann::json& c : cases) {
    const nlohmann::json& t = c["tags"];
    ShardTags tags;
    tags.tensor_model_parallel = t["tensor_model_parallel"].get<bool>();
    tags.partition_dim = t["partition_dim"].get<int>();
    tags.is_gtp_weight_remat = t["is_gtp_weight_remat"].get<bool>();
    tags.pad_length = t["pad_length"].get<int64_t>();
    const DomainSize domain{c["gtp_size"].get<int>(), c["tp_size"].get<int>()};
    absl::StatusOr<ParamShardSpec> spec = MakeShardSpec(
        "w", c["local_shape"].get<std::vector<int64_t>>(), tags, domain);
    const std::string why = c["why"].get<std::string>();
    ASSERT_TRUE(spec.ok()) << why << ": " << spec.status();
    EXPECT_EQ(spec->full_shape, c["full_shape"].get<std::vector<int64_t>>())
        << why;
  }
}

TEST(ShardingCasesTest, NsCost) {
  const nlohmann::json cases = LoadCases()["ns_cost"];
  ASSERT_FALSE(cases.empty());
  for (const nlohmann::json& c : cases) {
    EXPECT_EQ(NsCostOfShape(c["shape"].get<std::vector<int64_t>>()),
              c["cost"].get<double>())
        << c["shape"].dump();
  }
}

}  // namespace
}  // namespace muond
