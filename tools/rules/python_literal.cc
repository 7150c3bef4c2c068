#include "tools/rules/python_literal.h"

#include <charconv>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muond::rules {
namespace {

// std::to_chars's shortest round-trip form, with ".0" added to a whole
// number so that Python reads a float, not an int.
template <typename T>
std::string ShortestFloat(T value) {
  char buffer[64];
  const std::to_chars_result r =
      std::to_chars(buffer, buffer + sizeof(buffer), value);
  std::string text(buffer, r.ptr);
  if (text.find_first_of(".en") == std::string::npos) text += ".0";
  return text;
}

}  // namespace

std::string PyStr(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string PyFloat(double value) { return ShortestFloat(value); }

std::string PyFloat32(float value) { return ShortestFloat(value); }

std::string PyInt(int64_t value) { return absl::StrCat(value); }

std::string PyTuple(const std::vector<std::string>& literals) {
  if (literals.size() == 1) return absl::StrCat("(", literals[0], ",)");
  return absl::StrCat("(", absl::StrJoin(literals, ", "), ")");
}

std::string PyStrTuple(const std::vector<std::string>& items) {
  std::vector<std::string> literals;
  for (const std::string& item : items) literals.push_back(PyStr(item));
  return PyTuple(literals);
}

}  // namespace muond::rules
