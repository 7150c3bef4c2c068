// server/common/unix_socket.h PrivateSocketDir on the shared table
// socket_dir_cases.json, which test_socket_dir_cases.py runs the Python
// client's copy (muond.placement.default_socket) on.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "server/common/unix_socket.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

std::string Expand(const std::string& text, const std::string& tmp) {
  return absl::StrReplaceAll(
      text, {{"<tmp>", tmp}, {"<uid>", absl::StrCat(geteuid())}});
}

TEST(SocketDirCasesTest, PrivateSocketDirMatchesTheTable) {
  const nlohmann::json table = LoadCaseTable("socket_dir_cases.json");
  ASSERT_FALSE(table["cases"].empty());
  const std::string tmp = std::getenv("TEST_TMPDIR");
  for (const nlohmann::json& c : table["cases"]) {
    const std::string why = c["why"].get<std::string>();
    if (c["xdg_runtime_dir"].is_null()) {
      unsetenv("XDG_RUNTIME_DIR");
    } else {
      setenv("XDG_RUNTIME_DIR",
             Expand(c["xdg_runtime_dir"].get<std::string>(), tmp).c_str(), 1);
    }
    const absl::StatusOr<std::string> dir = PrivateSocketDir();
    ASSERT_TRUE(dir.ok()) << why << ": " << dir.status();
    EXPECT_EQ(*dir, Expand(c["dir"].get<std::string>(), tmp)) << why;
  }
}

}  // namespace
}  // namespace muond::rules
