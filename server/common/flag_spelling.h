#pragma once
// The one flag spelling of the C++ tool family (muond-daemon,
// muond-coordinator, muonctl): snake_case, the spelling absl flags use
// (--job_id, --token_file, --tls_ca, --timeout_s). Help, errors and docs use
// it. The dashed spelling users already type (--token-file, --tls-ca) is
// accepted too: these functions turn a dashed flag name into the snake_case
// one before the flags are parsed, leaving every value as typed.
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace muond {

// "--foo-bar" -> "--foo_bar" and "--foo-bar=v-w" -> "--foo_bar=v-w": only
// the name, between the leading "--" and the first '=', changes. Anything
// else is returned as is: a bare "--", a single-dash argument ("-h"), a
// positional argument.
std::string SnakeCaseFlag(absl::string_view arg);

// Every argument through SnakeCaseFlag, except values: up to a bare "--"
// (the arguments after it are positional and stay as typed), and the
// argument after a flag written without '=' when `reads_next(name)` says
// that flag (`name` snake_case, no leading dashes) takes its value from the
// next argument ("--token_file --odd-name" or "-token_file --odd-name":
// the file name stays).
std::vector<std::string> SnakeCaseFlags(
    const std::vector<std::string>& args,
    const std::function<bool(absl::string_view name)>& reads_next);

// `reads_next` for absl flags: a registered flag that is not a bool (absl
// reads "--flag value" for those; a bool never takes the next argument).
bool AbslFlagReadsNextArgument(absl::string_view name);

}  // namespace muond
