// The real muond / muond-coordinator binaries at startup and shutdown:
// --help exits 0 with the binary's flags, a missing --device fails before
// joining, a live socket is not taken over, SIGTERM removes the socket, an
// untokened coordinator serves this host alone.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/common/spawn.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using ::muond::testing::Runfile;

std::string TmpFile(const std::string& name) {
  const char* dir = getenv("TEST_TMPDIR");
  return absl::StrCat(dir ? dir : "/tmp", "/", name);
}

// Starts `args` with stdout+stderr into `log` (truncated first).
pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  const pid_t pid = ::muond::testing::Spawn(args, log, /*truncate=*/true);
  EXPECT_NE(pid, -1) << "could not start " << args[0];
  return pid;
}

int ExitCode(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool Exists(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0;
}

// Runs to completion; returns the exit code, output in *out.
int RunToExit(const std::vector<std::string>& args, std::string* out) {
  const std::string log = TmpFile("run.log");
  const int rc = ExitCode(Spawn(args, log));
  *out = Read(log);
  return rc;
}

TEST(Startup, HelpListsOwnFlagsAndExitsZero) {
  std::string out;
  EXPECT_EQ(RunToExit({Runfile("server/daemon/muond-daemon"), "--help"}, &out),
            0);
  EXPECT_THAT(out, HasSubstr("usage: muond"));
  EXPECT_THAT(out, HasSubstr("--world_size"));
  EXPECT_THAT(out, Not(HasSubstr("No flags matched")));
  EXPECT_EQ(
      RunToExit({Runfile("server/coordinator/muond-coordinator"), "--help"},
                &out),
      0);
  EXPECT_THAT(out, HasSubstr("usage: muond-coordinator"));
  EXPECT_THAT(out, HasSubstr("--port_file"));
  EXPECT_THAT(out, Not(HasSubstr("--world_size")));
}

TEST(Startup, FlagErrorsArePrecise) {
  std::string out;
  EXPECT_EQ(
      RunToExit({Runfile("server/daemon/muond-daemon"), "--rank=5",
                 "--world_size=2", "--job_id=j", "--coordinator=127.0.0.1:1"},
                &out),
      2);
  EXPECT_THAT(out, HasSubstr("--rank=5 must be in [0, --world_size=2)"));
  EXPECT_EQ(RunToExit({Runfile("server/coordinator/muond-coordinator"),
                       "--listen=foo"},
                      &out),
            2);
  EXPECT_THAT(out, HasSubstr("--listen='foo' is malformed"));
  // An empty coordinator port is refused at startup, not at RegisterParams.
  EXPECT_EQ(
      RunToExit({Runfile("server/daemon/muond-daemon"), "--host", "--rank=0",
                 "--world_size=1", "--job_id=j",
                 "--coordinator=127.0.0.1:", "--coordinator_timeout_s=600"},
                &out),
      2);
  EXPECT_THAT(out, HasSubstr("--coordinator='127.0.0.1:' is malformed"));
  EXPECT_THAT(out, Not(HasSubstr("serving on")));
}

// Refused at startup naming the flag, before joining (the coordinator is
// unreachable; --coordinator_timeout_s=1 ends a join attempt quickly):
// --comm_timeout_s=0 would only fail at the first engine build, after
// RegisterParams, leaving the trainer waiting for a plan; a job id outside
// CheckJobId's rule ('/' would break the default socket file name).
TEST(Startup, CommTimeoutAndJobIdAreCheckedAtStartup) {
  const std::vector<std::string> base = {Runfile("server/daemon/muond-daemon"),
                                         "--host",
                                         "--rank=0",
                                         "--world_size=1",
                                         "--coordinator=127.0.0.1:1",
                                         "--coordinator_timeout_s=1"};
  std::string out;
  std::vector<std::string> args = base;
  args.insert(args.end(), {"--job_id=j", "--comm_timeout_s=0"});
  EXPECT_EQ(RunToExit(args, &out), 2) << out;
  EXPECT_THAT(out, HasSubstr("--comm_timeout_s=0 must be >= 1"));
  args = base;
  args.push_back("--job_id=team/a");
  EXPECT_EQ(RunToExit(args, &out), 2) << out;
  EXPECT_THAT(out, HasSubstr("--job_id=\"team/a\" (6 bytes) must be 1-64 "
                             "characters of [A-Za-z0-9._-]"));
  EXPECT_THAT(out, Not(HasSubstr("serving on")));
  for (const char* poll : {"-0.5", "11", "nan"}) {
    args = base;
    args.insert(args.end(),
                {"--job_id=j", absl::StrCat("--step_channel_request_poll_ms=", poll)});
    EXPECT_EQ(RunToExit(args, &out), 2) << out;
    EXPECT_THAT(out, HasSubstr("must be in [0, 10] (0: sleep) or -1")) << poll;
  }
}

// No machine has 10000 GPUs: fails at startup, before joining (the
// coordinator address is unreachable, so a join attempt would hang).
TEST(Startup, MissingDeviceFailsBeforeJoining) {
  std::string out;
  EXPECT_EQ(
      RunToExit({Runfile("server/daemon/muond-daemon"), "--device=10000",
                 "--rank=0", "--world_size=1", "--job_id=j",
                 "--coordinator=127.0.0.1:1", "--coordinator_timeout_s=600"},
                &out),
      1);
  EXPECT_THAT(out, HasSubstr("--device=10000"));
  EXPECT_THAT(out, Not(HasSubstr("serving on")));
}

// A socket path too long: bind() of a path longer than sockaddr_un holds
// failed as "address in use?"; refused at startup naming the flag, the
// length and the limit.
TEST(Startup, OverlongSocketPathIsRefusedNamingTheLimit) {
  const std::string sock = "/tmp/" + std::string(120, 's') + ".sock";
  std::string out;
  EXPECT_EQ(
      RunToExit({Runfile("server/daemon/muond-daemon"), "--host", "--rank=0",
                 "--world_size=1", "--job_id=j", "--coordinator=127.0.0.1:1",
                 "--coordinator_timeout_s=1", "--listen=unix://" + sock},
                &out),
      1)
      << out;
  EXPECT_THAT(out, HasSubstr(absl::StrCat("--listen: unix socket path")));
  EXPECT_THAT(out, HasSubstr(absl::StrCat("is ", sock.size(),
                                          " bytes, longer than the 105")));
  EXPECT_THAT(out, Not(HasSubstr("address in use")));
  EXPECT_THAT(out, Not(HasSubstr("serving on")));
}

TEST(Startup, LiveSocketIsRefusedAndSigtermRemovesIt) {
  char dir[] = "/tmp/muond-startup-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string sock = absl::StrCat(dir, "/d.sock");
  // The first daemon listens, then keeps retrying the (absent) coordinator.
  const std::vector<std::string> args = {Runfile("server/daemon/muond-daemon"),
                                         "--host",
                                         "--rank=0",
                                         "--world_size=1",
                                         "--job_id=j",
                                         "--coordinator=127.0.0.1:1",
                                         "--coordinator_timeout_s=600",
                                         "--listen=unix://" + sock};
  const pid_t first = Spawn(args, TmpFile("first.log"));
  while (!Exists(sock)) absl::SleepFor(absl::Milliseconds(20));

  std::string out;
  EXPECT_EQ(RunToExit(args, &out), 1);
  EXPECT_THAT(out, HasSubstr("address in use by a live process"));
  EXPECT_TRUE(Exists(sock));

  kill(first, SIGTERM);
  EXPECT_EQ(ExitCode(first), 0);
  EXPECT_FALSE(Exists(sock));
  rmdir(dir);
}

TEST(Startup, CoordinatorSigtermRemovesPortFile) {
  const std::string port_file = TmpFile("coordinator.port");
  const pid_t pid = Spawn({Runfile("server/coordinator/muond-coordinator"),
                           "--listen=127.0.0.1:0", "--port_file=" + port_file},
                          TmpFile("coordinator.log"));
  while (!Exists(port_file)) absl::SleepFor(absl::Milliseconds(20));
  kill(pid, SIGTERM);
  EXPECT_EQ(ExitCode(pid), 0);
  EXPECT_FALSE(Exists(port_file));
}

// Starts `args`; true once it logs that it serves (then SIGTERM, exit 0),
// false when it exits first.
bool ServesThenStops(const std::vector<std::string>& args,
                     const std::string& log) {
  const pid_t pid = Spawn(args, log);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Read(log).find("serving on") != std::string::npos) {
      kill(pid, SIGTERM);
      EXPECT_EQ(ExitCode(pid), 0) << Read(log);
      return true;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

// Without a token the coordinator serves this host alone: a Unix socket
// serves; an address other hosts reach is refused naming --token_file and
// how to make one, unless --insecure_allow_untokened_tcp.
TEST(Startup, UntokenedCoordinatorServesThisHostOnly) {
  const std::string coordinator =
      Runfile("server/coordinator/muond-coordinator");
  char dir[] = "/tmp/muond-untokened-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string log = TmpFile("untokened.log");
  EXPECT_TRUE(ServesThenStops(
      {coordinator, absl::StrCat("--listen=unix://", dir, "/c.sock")}, log))
      << Read(log);
  EXPECT_THAT(Read(log), HasSubstr(absl::StrCat("serving on unix://", dir)));
  std::string out;
  EXPECT_EQ(RunToExit({coordinator, "--listen=0.0.0.0:0"}, &out), 2);
  EXPECT_THAT(out, HasSubstr("--listen=0.0.0.0:0 is reachable from other "
                             "hosts and no token is given"));
  EXPECT_THAT(out, HasSubstr("--token_file=FILE"));
  EXPECT_TRUE(ServesThenStops(
      {coordinator, "--listen=0.0.0.0:0", "--insecure_allow_untokened_tcp"},
      log))
      << Read(log);
  EXPECT_THAT(Read(log), HasSubstr("--insecure_allow_untokened_tcp: any host"));
  rmdir(dir);
}

// gRPC binds with SO_REUSEPORT unless told not to: a second coordinator on
// the port of a running one must fail at startup naming --listen, not serve
// beside it (the kernel would split the job's daemons between the two).
TEST(Startup, SecondCoordinatorOnABusyPortIsRefused) {
  const std::string port_file = TmpFile("busy.port");
  const pid_t first =
      Spawn({Runfile("server/coordinator/muond-coordinator"),
             "--listen=127.0.0.1:0", "--port_file=" + port_file},
            TmpFile("busy-first.log"));
  while (Read(port_file).empty()) absl::SleepFor(absl::Milliseconds(20));
  const std::string listen =
      absl::StrCat("--listen=127.0.0.1:", std::stoi(Read(port_file)));
  const std::string log = TmpFile("busy-second.log");
  const pid_t second =
      Spawn({Runfile("server/coordinator/muond-coordinator"), listen}, log);
  // Until it exits, or serves (the bug: then it is stopped here).
  int status = 0;
  bool served = false;
  while (waitpid(second, &status, WNOHANG) == 0) {
    if (Read(log).find("serving on") != std::string::npos) {
      served = true;
      kill(second, SIGTERM);
      waitpid(second, &status, 0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_FALSE(served) << Read(log);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << Read(log);
  EXPECT_THAT(Read(log), HasSubstr("cannot listen on 127.0.0.1:"));
  EXPECT_THAT(Read(log), HasSubstr("--listen"));
  kill(first, SIGTERM);
  EXPECT_EQ(ExitCode(first), 0);
}

// A TCP port nobody listens on now (bound to port 0, then released).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), len), 0);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  return ntohs(addr.sin_port);
}

// --metrics_port equal to --listen's port: the gRPC listener binds first,
// so the clash is reported by the metrics bind, naming its flags, and not
// as a busy --listen.
TEST(Startup, MetricsPortEqualToListenPortNamesMetricsPort) {
  const int port = UnusedPort();
  const std::string listen = absl::StrCat("--listen=127.0.0.1:", port);
  const std::string metrics = absl::StrCat("--metrics_port=", port);
  // A TCP daemon requires a token.
  const std::string token_file = TmpFile("metrics-clash.token");
  const int fd = open(token_file.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
  ASSERT_NE(fd, -1);
  ASSERT_EQ(write(fd, "t0ken", 5), 5);
  close(fd);
  const std::vector<std::vector<std::string>> servers = {
      {Runfile("server/coordinator/muond-coordinator"), listen, metrics},
      {Runfile("server/daemon/muond-daemon"), "--host", "--job_id=j",
       "--rank=0", "--world_size=1", "--coordinator=127.0.0.1:1",
       "--coordinator_timeout_s=1", "--token_file=" + token_file, listen,
       metrics}};
  for (const std::vector<std::string>& args : servers) {
    std::string out;
    EXPECT_EQ(RunToExit(args, &out), 1) << out;
    EXPECT_THAT(
        out, HasSubstr(absl::StrCat("cannot serve metrics on 127.0.0.1:", port,
                                    " (--metrics_address/--metrics_port)")))
        << args[0];
    EXPECT_THAT(out, HasSubstr("in use")) << args[0];
    EXPECT_THAT(out, Not(HasSubstr("cannot listen on"))) << args[0];
  }
}

}  // namespace
