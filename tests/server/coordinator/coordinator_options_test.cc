// The rule of a coordinator without a token (CheckUntokenedListen): it serves
// this host alone (IsThisHostOnly) unless told otherwise, whatever TLS says.
#include "server/coordinator/coordinator_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace muond {
namespace {

using ::testing::HasSubstr;

TEST(CoordinatorOptions, ThisHostOnlyAddresses) {
  for (const char* local :
       {"unix:///run/muond/c.sock", "unix:/tmp/c.sock", "127.0.0.1:7070",
        "127.1.2.3:0", "localhost:7070", "LocalHost:1", "[::1]:7070"}) {
    EXPECT_TRUE(IsThisHostOnly(local)) << local;
  }
  // A host name starting "127." or "localhost" resolves wherever DNS says.
  for (const char* remote :
       {"0.0.0.0:7070", "10.0.0.1:7070", "[::]:7070", "gpu001:7070",
        "127.example.com:7070", "localhost.example.com:7070", "128.0.0.1:7070",
        "[::2]:7070", "[::ffff:10.0.0.1]:7070"}) {
    EXPECT_FALSE(IsThisHostOnly(remote)) << remote;
  }
}

TEST(CoordinatorOptions, UntokenedListenServesThisHostOnlyUnlessOptedOut) {
  EXPECT_TRUE(CheckUntokenedListen("127.0.0.1:0", false, false).ok());
  EXPECT_TRUE(CheckUntokenedListen("unix:///tmp/c.sock", false, false).ok());
  EXPECT_TRUE(CheckUntokenedListen("0.0.0.0:7070", true, false).ok());
  EXPECT_TRUE(CheckUntokenedListen("0.0.0.0:7070", false, true).ok());
  const absl::Status refused =
      CheckUntokenedListen("0.0.0.0:7070", false, false);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(), HasSubstr("--listen=0.0.0.0:7070"));
  EXPECT_THAT(refused.message(), HasSubstr("--token_file=FILE"));
  EXPECT_THAT(refused.message(), HasSubstr("umask 077"));
  EXPECT_THAT(refused.message(), HasSubstr("--insecure_allow_untokened_tcp"));
  EXPECT_FALSE(
      CheckUntokenedListen("127.evil.example:7070", false, false).ok());
}

}  // namespace
}  // namespace muond
