#include "tests/rules/case_table.h"

#include <gtest/gtest.h>

#include <fstream>

namespace muond::rules {

nlohmann::json LoadCaseTable(const std::string& name) {
  std::ifstream in("tests/rules/" + name);
  EXPECT_TRUE(in.good()) << name << " is not in the runfiles";
  if (!in.good()) return nlohmann::json::object();
  return nlohmann::json::parse(in);
}

void ExpectCaseOutcome(const nlohmann::json& c, const absl::Status& status) {
  const std::string why = c["why"].get<std::string>();
  if (c["error"].is_null()) {
    EXPECT_TRUE(status.ok()) << why << ": " << status;
    return;
  }
  EXPECT_FALSE(status.ok()) << why;
  EXPECT_NE(status.message().find(c["error"].get<std::string>()),
            std::string::npos)
      << why << ": " << status;
}

double JsonDouble(const nlohmann::json& value) {
  if (value.is_string()) return std::stod(value.get<std::string>());
  return value.get<double>();
}

}  // namespace muond::rules
