// core/common/state_options.h AutoStateDType on the shared table
// auto_state_dtype_cases.json, which test_auto_state_dtype_cases.py runs the
// Python client's copy of the rule on.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/common/dtype.h"
#include "core/common/state_options.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

DType ParamDType(const std::string& name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    if (DTypeName(d) == name) return d;
  }
  ADD_FAILURE() << "unknown param dtype " << name;
  return DType::kFloat32;
}

TEST(AutoStateDTypeCasesTest, AutoStateDTypeMatchesTheTable) {
  const nlohmann::json table = LoadCaseTable("auto_state_dtype_cases.json");
  ASSERT_FALSE(table["cases"].empty());
  for (const nlohmann::json& c : table["cases"]) {
    std::vector<DType> dtypes;
    for (const nlohmann::json& d : c["param_dtypes"]) {
      dtypes.push_back(ParamDType(d.get<std::string>()));
    }
    EXPECT_EQ(DTypeName(AutoStateDType(dtypes)),
              c["state_dtype"].get<std::string>())
        << c["why"].get<std::string>();
  }
}

}  // namespace
}  // namespace muond::rules
