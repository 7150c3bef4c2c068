#pragma once
// Python source literals for the generated client/python/muond/_rules.py:
// values printed so that Python reads back exactly the C++ value.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace muond::rules {

// A double-quoted Python str. The values are names and keys (printable
// ASCII); a backslash or quote is escaped all the same.
std::string PyStr(std::string_view text);

// The shortest decimal that reads back as `value` (Python float), e.g. 0.2.
std::string PyFloat(double value);

// The shortest decimal that reads back as the float32 `value`: 3.4445f prints
// as 3.4445, the literal the coefficient tables are written with.
std::string PyFloat32(float value);

std::string PyInt(int64_t value);

// ("a", "b") with a trailing comma for one element, as Python needs.
std::string PyStrTuple(const std::vector<std::string>& items);
std::string PyTuple(const std::vector<std::string>& literals);

}  // namespace muond::rules
