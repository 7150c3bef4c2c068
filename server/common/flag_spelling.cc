#include "server/common/flag_spelling.h"

#include <algorithm>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"

namespace muond {

std::string SnakeCaseFlag(absl::string_view arg) {
  std::string out(arg);
  if (!absl::StartsWith(arg, "--") || arg.size() == 2) return out;
  const size_t name_end = std::min(out.find('='), out.size());
  std::replace(out.begin() + 2, out.begin() + name_end, '-', '_');
  return out;
}

std::vector<std::string> SnakeCaseFlags(
    const std::vector<std::string>& args,
    const std::function<bool(absl::string_view name)>& reads_next) {
  std::vector<std::string> out;
  out.reserve(args.size());
  bool positional = false;
  bool value_next = false;
  for (const std::string& arg : args) {
    if (positional || value_next) {
      out.push_back(arg);
      value_next = false;
      continue;
    }
    if (arg == "--") positional = true;
    out.push_back(SnakeCaseFlag(arg));
    // absl reads "-flag value" as it reads "--flag value": the value after a
    // single-dash flag stays as typed too.
    absl::string_view name = out.back();
    if (!absl::ConsumePrefix(&name, "--")) absl::ConsumePrefix(&name, "-");
    if (name.size() < out.back().size() && !name.empty() &&
        !absl::StrContains(name, '=')) {
      value_next = reads_next(name);
    }
  }
  return out;
}

bool AbslFlagReadsNextArgument(absl::string_view name) {
  const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  return flag != nullptr && !flag->IsOfType<bool>();
}

}  // namespace muond
