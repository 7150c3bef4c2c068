// Startup checks of muond / muond-coordinator: flag messages, --help, the
// live-socket refusal and the SIGTERM watcher (server/common).
#include "server/common/cli.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/synchronization/notification.h"
#include "server/common/shutdown.h"
#include "server/common/unix_socket.h"

ABSL_FLAG(int, cli_test_flag, 7, "A flag of this test file");

namespace muond {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(CheckDaemonIdentityFlags, NamesTheBrokenRule) {
  EXPECT_TRUE(CheckDaemonIdentityFlags("j", "h:1", 1, 2).ok());
  absl::Status st = CheckDaemonIdentityFlags("j", "h:1", 5, 2);
  EXPECT_EQ(st.message(), "--rank=5 must be in [0, --world_size=2)");
  st = CheckDaemonIdentityFlags("", "h:1", 0, 1);
  EXPECT_EQ(st.message(), "--job_id is required");
  st = CheckDaemonIdentityFlags(std::string(65, 'j'), "h:1", 0, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              ::testing::HasSubstr("--job_id=\"" + std::string(64, 'j') +
                                   "...\" (65 bytes) must be 1-64 characters "
                                   "of [A-Za-z0-9._-]"));
  EXPECT_TRUE(CheckDaemonIdentityFlags(std::string(64, 'j'), "h:1", 0, 1).ok());
  st = CheckDaemonIdentityFlags("j", "", 0, 1);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("--coordinator is required"));
  st = CheckDaemonIdentityFlags("j", "h:1", -1, 2);
  EXPECT_THAT(std::string(st.message()), HasSubstr("--rank is required"));
  EXPECT_THAT(std::string(st.message()), Not(HasSubstr("world_size")));
  st = CheckDaemonIdentityFlags("j", "h:1", 0, -1);
  EXPECT_THAT(std::string(st.message()), HasSubstr("--world_size is required"));
  st = CheckDaemonIdentityFlags("j", "h:1", 0, 0);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("--world_size=0 must be >= 1"));
}

TEST(CheckListenAddress, AcceptsHostPortAndUnix) {
  for (const char* ok : {"127.0.0.1:7070", "0.0.0.0:0", "localhost:1",
                         "[::1]:7070", "[::]:65535", "unix:/tmp/x.sock",
                         "unix:///tmp/x.sock", "my-host.example:80"}) {
    EXPECT_TRUE(CheckListenAddress("--listen", ok).ok()) << ok;
  }
}

TEST(CheckListenAddress, SaysMalformed) {
  for (const char* bad : {"foo", "foo:", ":7070", "foo:bar", "foo:70000",
                          "unix:relative.sock", "a b:1"}) {
    absl::Status st = CheckListenAddress("--listen", bad);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << bad;
    EXPECT_THAT(std::string(st.message()),
                HasSubstr(std::string("--listen='") + bad + "' is malformed"));
  }
}

TEST(CheckCudaDeviceIndex, NoDeviceAndOutOfRange) {
  EXPECT_TRUE(CheckCudaDeviceIndex(1, 2, "").ok());
  absl::Status st = CheckCudaDeviceIndex(0, 0, "");
  EXPECT_TRUE(absl::IsFailedPrecondition(st));
  EXPECT_THAT(std::string(st.message()), HasSubstr("no CUDA device"));
  st = CheckCudaDeviceIndex(0, 0, "driver too old");
  EXPECT_THAT(std::string(st.message()), HasSubstr("driver too old"));
  st = CheckCudaDeviceIndex(2, 2, "");
  EXPECT_EQ(st.message(),
            "--device=2 is out of range: 2 CUDA device(s) visible, valid "
            "indices are [0, 2)");
}

TEST(ServerHelp, ListsOnlyTheBinarysFlags) {
  std::ostringstream out;
  PrintServerHelp(out, "usage: x", {"tests/server/common/cli_test"});
  EXPECT_EQ(out.str(),
            "usage: x\n\nFlags:\n  --cli_test_flag (default: 7)\n"
            "      A flag of this test file\n");
}

TEST(ServerHelp, WantsHelp) {
  char prog[] = "p", help[] = "--help", h[] = "-h", other[] = "--rank=1",
       dashdash[] = "--";
  char* a1[] = {prog, other, help};
  EXPECT_TRUE(WantsHelp(3, a1));
  char* a2[] = {prog, h};
  EXPECT_TRUE(WantsHelp(2, a2));
  char* a3[] = {prog, other};
  EXPECT_FALSE(WantsHelp(2, a3));
  char* a4[] = {prog, dashdash, help};
  EXPECT_FALSE(WantsHelp(3, a4));
}

class UnixSocketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Not TEST_TMPDIR: sun_path holds at most 107 bytes.
    dir_ = "/tmp/muond-cli-test-XXXXXX";
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
    path_ = dir_ + "/x.sock";
  }
  // A bound (and, when `listen`, listening) socket at path_.
  int Bind(bool listen_on_it) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    if (listen_on_it) {
      EXPECT_EQ(listen(fd, 1), 0);
    }
    return fd;
  }
  bool Exists() {
    struct stat st;
    return lstat(path_.c_str(), &st) == 0;
  }
  void TearDown() override {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  std::string dir_, path_;
};

TEST_F(UnixSocketTest, RefusesALiveSocket) {
  const int fd = Bind(/*listen_on_it=*/true);
  absl::Status st = PrepareUnixSocketPath(path_);
  EXPECT_TRUE(absl::IsFailedPrecondition(st));
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("address in use by a live process"));
  EXPECT_TRUE(Exists());
  close(fd);
}

TEST_F(UnixSocketTest, ReplacesAStaleSocket) {
  close(Bind(/*listen_on_it=*/false));  // file stays, nobody listens
  ASSERT_TRUE(Exists());
  EXPECT_TRUE(CheckSocketIsStale(path_).ok());
  EXPECT_TRUE(PrepareUnixSocketPath(path_).ok());
  EXPECT_FALSE(Exists());
}

TEST(ShutdownSignalWatcher, RunsTheHandlerOnSigterm) {
  InstallShutdownSignalHandler();
  absl::Notification fired;
  int got = 0;
  ShutdownSignalWatcher watcher([&](int signum) {
    got = signum;
    fired.Notify();
  });
  kill(getpid(), SIGTERM);
  fired.WaitForNotification();
  EXPECT_EQ(got, SIGTERM);
}

TEST(ShutdownSignalWatcher, StopsWithoutASignal) {
  InstallShutdownSignalHandler();
  bool called = false;
  {
    ShutdownSignalWatcher watcher([&](int) { called = true; });
  }
  EXPECT_FALSE(called);
}

}  // namespace
}  // namespace muond
