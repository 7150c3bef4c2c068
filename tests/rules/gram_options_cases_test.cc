// The daemon's Gram Newton-Schulz option rules (core/muon/newton_schulz.h) on
// the shared table gram_options_cases.json, which
// test_gram_options_cases.py runs the Python client's copy of the rules on.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/backend/backend.h"
#include "core/common/status_macros.h"
#include "core/muon/newton_schulz.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

std::vector<NsCoefficients> Coefficients(const nlohmann::json& triples) {
  std::vector<NsCoefficients> out;
  for (const nlohmann::json& t : triples) {
    out.push_back({t[0].get<float>(), t[1].get<float>(), t[2].get<float>()});
  }
  return out;
}

// The case's options as the daemon reads them (names parsed as
// proto_convert_options does), then ValidateGramOptions.
absl::Status CheckCase(const nlohmann::json& c) {
  NsOptions options;
  options.num_steps = c["ns_steps"].get<int>();
  ASSIGN_OR_RETURN(options.algorithm,
                   ParseNsAlgorithm(c["ns_algorithm"].get<std::string>()));
  ASSIGN_OR_RETURN(options.gram_dtype,
                   ParseGramDType(c["gram_dtype"].get<std::string>()));
  ASSIGN_OR_RETURN(options.precision, ParseMatmulPrecision(c.value(
                                          "fp32_matmul_prec", "highest")));
  if (!c["gram_restarts"].is_null()) {
    options.gram_restarts = c["gram_restarts"].get<std::vector<int>>();
  }
  if (!c["gram_min_aspect_ratio"].is_null()) {
    options.gram_min_aspect_ratio = JsonDouble(c["gram_min_aspect_ratio"]);
  }
  if (c.contains("custom_coefficients")) {
    options.coefficient_type = CoefficientType::kCustom;
    options.custom = Coefficients(c["custom_coefficients"]);
  }
  return ValidateGramOptions(options);
}

TEST(GramOptionsCasesTest, ValidateGramOptionsMatchesTheTable) {
  const nlohmann::json table = LoadCaseTable("gram_options_cases.json");
  ASSERT_FALSE(table["cases"].empty());
  for (const nlohmann::json& c : table["cases"]) {
    ExpectCaseOutcome(c, CheckCase(c));
  }
}

}  // namespace
}  // namespace muond::rules
