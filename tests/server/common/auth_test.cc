// server/common/auth: the start-up checks of TLS files and tokens name the
// flag, the path and the real cause (rather than gRPC's "empty address list"
// or a failed bind). Certificates come from the openssl CLI.
#include "server/common/auth.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(std::getenv("TEST_TMPDIR"), "/auth");
    ASSERT_EQ(std::system(absl::StrCat("mkdir -p ", dir_).c_str()), 0);
  }

  // A self-signed certificate `name`.crt and its 0600 key `name`.key.
  void MakePair(const std::string& name) {
    const std::string cmd = absl::StrCat(
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=x "
        "-keyout ",
        dir_, "/", name, ".key -out ", dir_, "/", name, ".crt 2>/dev/null");
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    ASSERT_EQ(chmod(Path(name + ".key").c_str(), 0600), 0);
  }

  std::string Path(const std::string& file) const {
    return absl::StrCat(dir_, "/", file);
  }

  std::string Write(const std::string& file, const std::string& text,
                    mode_t mode) {
    const std::string path = Path(file);
    std::ofstream(path) << text;
    chmod(path.c_str(), mode);
    return path;
  }

  std::string dir_;
};

TEST_F(AuthTest, GarbageCaFileIsRefusedNamingTheFlag) {
  const std::string garbage = Write("garbage.pem", "not a certificate\n", 0644);
  auto creds = ChannelCredentials(garbage, "--coordinator_tls_ca");
  ASSERT_FALSE(creds.ok());
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(creds.status().message()),
              HasSubstr(absl::StrCat("--coordinator_tls_ca='", garbage,
                                     "': holds no PEM certificate")));
  // A PEM header around garbage does not parse either.
  const std::string broken = Write(
      "broken.pem",
      "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", 0644);
  creds = ChannelCredentials(broken, "--tls_ca");
  ASSERT_FALSE(creds.ok());
  EXPECT_THAT(std::string(creds.status().message()),
              HasSubstr("--tls_ca='" + broken +
                        "': its PEM certificate "
                        "does not parse"));
}

TEST_F(AuthTest, MissingCaFileNamesTheFlagItWasGivenAs) {
  auto creds = ChannelCredentials(Path("absent.pem"), "--coordinator_tls_ca");
  ASSERT_FALSE(creds.ok());
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(creds.status().message()),
              HasSubstr("--coordinator_tls_ca='" + Path("absent.pem") + "'"));
  MakePair("ca");
  EXPECT_TRUE(ChannelCredentials(Path("ca.crt"), "--tls_ca").ok());
}

TEST_F(AuthTest, MismatchedCertificateAndKeyAreRefused) {
  MakePair("a");
  MakePair("b");
  EXPECT_TRUE(ServerCredentials(Path("a.crt"), Path("a.key")).ok());
  auto creds = ServerCredentials(Path("a.crt"), Path("b.key"));
  ASSERT_FALSE(creds.ok());
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(creds.status().message()),
              HasSubstr("--tls_cert='" + Path("a.crt") + "' and --tls_key='" +
                        Path("b.key") +
                        "': the key is not the certificate's private key"));
}

// The rule of a token file holds for the private key too: readable by other
// users is refused.
TEST_F(AuthTest, OtherReadableKeyIsRefusedLikeATokenFile) {
  MakePair("open");
  ASSERT_EQ(chmod(Path("open.key").c_str(), 0644), 0);
  auto creds = ServerCredentials(Path("open.crt"), Path("open.key"));
  ASSERT_FALSE(creds.ok());
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(creds.status().message()),
              HasSubstr("--tls_key='" + Path("open.key") +
                        "': readable or writable by other users (mode 0644)"));
  const std::string token = Write("token", "secret\n", 0644);
  auto read = ReadTokenFile(token, "--token_file");
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(std::string(read.status().message()),
              HasSubstr("readable or writable by other users (mode 0644)"));
  // A key file holding no key.
  const std::string empty = Write("empty.key", "\n", 0600);
  creds = ServerCredentials(Path("open.crt"), empty);
  ASSERT_FALSE(creds.ok());
  EXPECT_THAT(std::string(creds.status().message()),
              HasSubstr("holds no PEM private key"));
}

TEST_F(AuthTest, CommandLineTokenFollowsTheTokenFileRule) {
  for (const std::string bad : {"a b", "tab\there", "new\nline", "\x7f"}) {
    absl::StatusOr<std::string> token = TokenFromFlags(bad, "");
    ASSERT_FALSE(token.ok()) << bad;
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(token.status().message()),
                HasSubstr("--token: the token must be printable ASCII "
                          "without spaces"));
  }
  EXPECT_FALSE(TokenFromFlags(std::string(kMaxTokenBytes + 1, 'x'), "").ok());
  absl::StatusOr<std::string> good = TokenFromFlags("s3cr3t-token", "");
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(*good, "s3cr3t-token");
  EXPECT_EQ(*TokenFromFlags("", ""), "");
}

}  // namespace
}  // namespace muond
