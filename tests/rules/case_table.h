#pragma once
// Reads a shared case table of tests/rules (the same JSON file a Python test
// runs the client's copy of the rule on).
#include <string>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace muond::rules {

// The parsed tests/rules/<name>; a test failure and an empty object when the
// file is missing from the runfiles.
nlohmann::json LoadCaseTable(const std::string& name);

// A JSON number, or one of the strings "inf", "-inf", "nan" (JSON has no
// literal for them), as a double.
double JsonDouble(const nlohmann::json& value);

// The outcome a case expects of the C++ rule: accepted when its "error" is
// null, else refused with a message containing "error". Failures name the
// case by its "why".
void ExpectCaseOutcome(const nlohmann::json& c, const absl::Status& status);

}  // namespace muond::rules
