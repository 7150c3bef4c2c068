// server/common/auth.h ReadTokenFile on the shared table
// token_file_cases.json, which test_token_file_cases.py runs the Python
// client's copy (muond.client.read_token_file) on.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/escaping.h"
#include "server/common/auth.h"
#include "tests/rules/case_table.h"

namespace muond::rules {
namespace {

std::string Content(const nlohmann::json& c) {
  const std::string once =
      c.contains("content_hex")
          ? absl::HexStringToBytes(c["content_hex"].get<std::string>())
          : c["content"].get<std::string>();
  std::string out;
  for (int i = 0; i < c.value("repeat", 1); ++i) out += once;
  return out;
}

// The case's file (or directory, or nothing) at a fresh path under the
// test's temporary directory.
std::string MakeCase(const nlohmann::json& c, int index) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) +
                           "/token_case_" + std::to_string(index);
  const std::string kind = c.value("kind", "file");
  if (kind == "missing") return path;
  const mode_t mode = std::stoi(c["mode"].get<std::string>(), nullptr, 8);
  if (kind == "directory") {
    EXPECT_EQ(mkdir(path.c_str(), mode), 0) << path;
  } else {
    std::ofstream(path, std::ios::binary) << Content(c);
  }
  EXPECT_EQ(chmod(path.c_str(), mode), 0) << path;
  return path;
}

void ExpectToken(const nlohmann::json& c,
                 const absl::StatusOr<std::string>& token) {
  const std::string why = c["why"].get<std::string>();
  ASSERT_TRUE(token.ok()) << why << ": " << token.status();
  if (c.contains("token_bytes")) {
    EXPECT_EQ(int64_t(token->size()), c["token_bytes"].get<int64_t>()) << why;
  } else {
    EXPECT_EQ(*token, c["token"].get<std::string>()) << why;
  }
}

TEST(TokenFileCasesTest, ReadTokenFileMatchesTheTable) {
  const nlohmann::json table = LoadCaseTable("token_file_cases.json");
  ASSERT_FALSE(table["cases"].empty());
  int index = 0;
  for (const nlohmann::json& c : table["cases"]) {
    const absl::StatusOr<std::string> token =
        ReadTokenFile(MakeCase(c, index++), "--token_file");
    if (!c.contains("error")) {
      ExpectToken(c, token);
      continue;
    }
    EXPECT_FALSE(token.ok()) << c["why"];
    EXPECT_NE(token.status().message().find(c["error"].get<std::string>()),
              std::string::npos)
        << c["why"] << ": " << token.status();
  }
}

}  // namespace
}  // namespace muond::rules
