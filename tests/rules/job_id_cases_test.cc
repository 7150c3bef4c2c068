// server/common/job_id.h CheckJobId on the shared table job_id_cases.json,
// which test_job_id_cases.py runs the Python client's copy of the rule on.
#include <gtest/gtest.h>

#include <string>

#include "server/common/job_id.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

TEST(JobIdCasesTest, CheckJobIdMatchesTheTable) {
  const nlohmann::json table = LoadCaseTable("job_id_cases.json");
  ASSERT_FALSE(table["cases"].empty());
  for (const nlohmann::json& c : table["cases"]) {
    ExpectCaseOutcome(c,
                      CheckJobId("--job_id", c["job_id"].get<std::string>()));
  }
}

}  // namespace
}  // namespace muond::rules
