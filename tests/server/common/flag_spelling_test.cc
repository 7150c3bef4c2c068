// The flag spelling rule of the C++ tools: a dashed flag name becomes its
// snake_case spelling before absl parses argv; values, single-dash arguments
// and everything after a bare "--" stay as typed. Checked on the rewrite's
// edge cases and through absl's own parser with flags of every kind.
#include "server/common/flag_spelling.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"

ABSL_FLAG(std::string, token_file, "", "test flag: a string");
ABSL_FLAG(int, timeout_s, 10, "test flag: an int");
ABSL_FLAG(bool, dry_run, false, "test flag: a bool");

namespace muond {
namespace {

using ::testing::ElementsAre;

TEST(SnakeCaseFlag, RewritesOnlyTheNameOfADoubleDashFlag) {
  EXPECT_EQ(SnakeCaseFlag("--token-file"), "--token_file");
  EXPECT_EQ(SnakeCaseFlag("--token-file=/a-b/c-d"), "--token_file=/a-b/c-d");
  EXPECT_EQ(SnakeCaseFlag("--a-b-c=x=y-z"), "--a_b_c=x=y-z");
  EXPECT_EQ(SnakeCaseFlag("--token_file=x-y"), "--token_file=x-y");
  EXPECT_EQ(SnakeCaseFlag("--no-dry-run"), "--no_dry_run");
  EXPECT_EQ(SnakeCaseFlag("--=a-b"), "--=a-b");
}

TEST(SnakeCaseFlag, LeavesEverythingElseAsTyped) {
  EXPECT_EQ(SnakeCaseFlag("--"), "--");
  EXPECT_EQ(SnakeCaseFlag("-h"), "-h");
  EXPECT_EQ(SnakeCaseFlag("-token-file"), "-token-file");
  EXPECT_EQ(SnakeCaseFlag("my-job"), "my-job");
  EXPECT_EQ(SnakeCaseFlag("-"), "-");
  EXPECT_EQ(SnakeCaseFlag(""), "");
}

// A flag that reads the next argument: "token_file" and "timeout_s" only.
bool ReadsNext(absl::string_view name) {
  return name == "token_file" || name == "timeout_s";
}

TEST(SnakeCaseFlags, ValuesAndPositionalArgumentsStayAsTyped) {
  EXPECT_THAT(
      SnakeCaseFlags({"--token-file", "--odd-name", "--timeout-s=5",
                      "--dry-run", "--next-flag", "--", "--after-it", "x-y"},
                     ReadsNext),
      ElementsAre("--token_file", "--odd-name", "--timeout_s=5", "--dry_run",
                  "--next_flag", "--", "--after-it", "x-y"));
}

TEST(SnakeCaseFlags, AValueAfterEqualsDoesNotTakeTheNextArgument) {
  EXPECT_THAT(
      SnakeCaseFlags({"--token-file=f", "--timeout-s", "3", "--dry-run"},
                     ReadsNext),
      ElementsAre("--token_file=f", "--timeout_s", "3", "--dry_run"));
}

TEST(SnakeCaseFlags, TheValueOfASingleDashFlagStaysAsTyped) {
  // absl reads "-token_file F" like "--token_file F".
  EXPECT_THAT(
      SnakeCaseFlags({"-token_file", "--my-token", "-timeout_s=3", "--dry-run"},
                     ReadsNext),
      ElementsAre("-token_file", "--my-token", "-timeout_s=3", "--dry_run"));
  EXPECT_THAT(SnakeCaseFlags({"-", "--dry-run"}, ReadsNext),
              ElementsAre("-", "--dry_run"));
}

TEST(SnakeCaseFlags, AFlagLastOnTheLineLeavesNothingToSkip) {
  EXPECT_THAT(SnakeCaseFlags({"--token-file"}, ReadsNext),
              ElementsAre("--token_file"));
  EXPECT_THAT(SnakeCaseFlags({}, ReadsNext), ElementsAre());
}

TEST(AbslFlagReadsNextArgument, NonBoolRegisteredFlagsOnly) {
  EXPECT_TRUE(AbslFlagReadsNextArgument("token_file"));
  EXPECT_TRUE(AbslFlagReadsNextArgument("timeout_s"));
  EXPECT_FALSE(AbslFlagReadsNextArgument("dry_run"));
  EXPECT_FALSE(AbslFlagReadsNextArgument("no_such_flag"));
}

// What the servers' main does: both spellings, rewritten, parsed by absl.
TEST(AbslFlagReadsNextArgument, BothSpellingsParseToTheSameFlags) {
  for (const std::vector<std::string>& typed :
       std::vector<std::vector<std::string>>{
           {"--token-file", "--a-file", "--timeout-s=7", "--dry-run"},
           {"--token_file", "--a-file", "--timeout_s=7", "--dry_run"},
           {"--token-file=--a-file", "--timeout-s", "7", "--dry-run=true"}}) {
    absl::SetFlag(&FLAGS_token_file, "");
    absl::SetFlag(&FLAGS_timeout_s, 10);
    absl::SetFlag(&FLAGS_dry_run, false);
    std::vector<std::string> args =
        SnakeCaseFlags(typed, AbslFlagReadsNextArgument);
    args.insert(args.begin(), "prog");
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
    EXPECT_EQ(absl::GetFlag(FLAGS_token_file), "--a-file") << typed[0];
    EXPECT_EQ(absl::GetFlag(FLAGS_timeout_s), 7) << typed[0];
    EXPECT_TRUE(absl::GetFlag(FLAGS_dry_run)) << typed[0];
  }
}

}  // namespace
}  // namespace muond
