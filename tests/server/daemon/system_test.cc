// Multi-process system test: muond-coordinator + 4 muond daemons
// (2x2 domain, host mode, Gloo) + 4 trainer processes using the C++ client.
// The trainers check their shards bitwise against the single-process
// reference after 3 steps; rank 0 issues a Rebalance with another cost table
// that changes homes from step 2 on. Run at fp32_matmul_prec "highest" and
// "medium" (bf16 NS input, exchanges and output; the reference runs bf16 NS
// too). Launches the real binaries (data deps, or MUOND_BIN_DIR).
// Built with MUOND_SYSTEM_TEST_CUDA (system_cuda_test, tag gpu) it runs the
// same on 4 GPUs instead: daemon and trainer r on GPU r, CUDA IPC, NCCL.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/common/files.h"
#include "tests/common/spawn.h"

namespace {

using muond::testing::Runfile;

// Starts `args` with stdout and stderr in `log` (truncated) when given.
pid_t Spawn(const std::vector<std::string>& args, const std::string& log = "") {
  const pid_t pid = muond::testing::Spawn(args, log, /*truncate=*/true);
  EXPECT_GT(pid, 0) << args[0];
  return pid;
}

// Waits for `pid` up to `deadline`; -1 on timeout (then kills it).
int WaitExit(pid_t pid, absl::Time deadline) {
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Coordinator + 4 daemons + 4 trainers at `precision` (and a second group
// at `second_precision` on the same domain when set); the trainers exit 0
// when their shards are bitwise the reference's. `cuda`: daemon and trainer
// r on GPU r (CUDA IPC, NCCL), the reference on the CUDA backend.
void RunFourDaemonsFourTrainers(const std::string& precision,
                                const std::string& second_precision = "",
                                bool cuda = false) {
  char dir_template[] = "/tmp/muond-sys-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);  // mode 0700
  const std::string dir = dir_template;
  const std::string job =
      absl::StrCat("sys", getpid(), precision, second_precision);

  std::vector<pid_t> servers;
  servers.push_back(
      Spawn({Runfile("server/coordinator/muond-coordinator"),
             "--listen=127.0.0.1:0", "--port_file=" + dir + "/port"}));
  ASSERT_TRUE(muond::testing::WaitForFile(dir + "/port", absl::Seconds(10)));
  int port = 0;
  std::ifstream(dir + "/port") >> port;
  ASSERT_GT(port, 0);
  const std::string coordinator = absl::StrCat("127.0.0.1:", port);

  std::vector<std::string> sockets;
  for (int r = 0; r < 4; ++r) {
    sockets.push_back(absl::StrCat(dir, "/d", r, ".sock"));
    servers.push_back(Spawn({Runfile("server/daemon/muond-daemon"),
                             cuda ? absl::StrCat("--device=", r) : "--host",
                             "--coordinator=" + coordinator, "--job_id=" + job,
                             absl::StrCat("--rank=", r), "--world_size=4",
                             "--listen=unix://" + sockets.back(),
                             "--log_every=1", "--comm_timeout_s=30"}));
  }
  for (const std::string& s : sockets) {
    ASSERT_TRUE(muond::testing::WaitForFile(s, absl::Seconds(10))) << s;
    struct stat st;
    ASSERT_EQ(stat(s.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << s;
  }

  std::vector<pid_t> trainers;
  for (int r = 0; r < 4; ++r) {
    trainers.push_back(Spawn(
        {Runfile("tests/server/daemon/system_trainer"),
         "--daemon=unix://" + sockets[r], "--coordinator=" + coordinator,
         "--job=" + job, absl::StrCat("--rank=", r), "--precision=" + precision,
         "--second_precision=" + second_precision,
         r == 0 ? "--rebalance" : "--expect_rebalance",
         absl::StrCat("--device=", cuda ? r : -1)}));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(45);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(WaitExit(trainers[r], deadline), 0)
        << "trainer " << r << " (" << precision << ")";
  }

  // The operator's view of the finished job.
  const std::string status_out = dir + "/status.txt";
  EXPECT_EQ(WaitExit(Spawn({Runfile("tools/muonctl/muonctl"), "status",
                            "--coordinator=" + coordinator, "--job=" + job},
                           status_out),
                     absl::Now() + absl::Seconds(10)),
            0);
  const std::string status = muond::testing::ReadFile(status_out);
  EXPECT_NE(status.find("plan version 2, activates at step 2"),
            std::string::npos)
      << status;
  const std::string daemons_out = dir + "/daemons.txt";
  EXPECT_EQ(WaitExit(Spawn({Runfile("tools/muonctl/muonctl"), "daemons",
                            "--coordinator=" + coordinator, "--job=" + job},
                           daemons_out),
                     absl::Now() + absl::Seconds(10)),
            0);
  const std::string daemons = muond::testing::ReadFile(daemons_out);
  EXPECT_NE(daemons.find(absl::StrCat("3  ")), std::string::npos) << daemons;
  EXPECT_NE(daemons.find("unix://" + sockets[3]), std::string::npos) << daemons;
  unlink(status_out.c_str());
  unlink(daemons_out.c_str());

  for (pid_t pid : servers) kill(pid, SIGTERM);
  for (pid_t pid : servers) WaitExit(pid, absl::Now() + absl::Seconds(5));
  for (const std::string& s : sockets) unlink(s.c_str());
  unlink((dir + "/port").c_str());
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

#ifdef MUOND_SYSTEM_TEST_CUDA
// CUDA devices visible to this process (the /dev/nvidiaN nodes, so the test
// itself needs no CUDA runtime).
int CudaDeviceNodes() {
  int n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev", ec)) {
    const std::string name = e.path().filename();
    n += name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
         std::all_of(name.begin() + 6, name.end(), ::isdigit);
  }
  return n;
}

// The full system on GPUs: one muond and one trainer process per GPU, the
// trainers' shards in device memory handed over by CUDA IPC, NCCL between
// the daemons; bitwise the single-GPU reference, with a rebalance.
TEST(SystemCudaTest, FourGpusFourTrainersBitwiseWithRebalance) {
  if (CudaDeviceNodes() < 4) GTEST_SKIP() << "needs 4 CUDA devices";
  RunFourDaemonsFourTrainers("highest", "", /*cuda=*/true);
  RunFourDaemonsFourTrainers("medium", "", /*cuda=*/true);
}
#else
TEST(SystemTest, FourDaemonsFourTrainersBitwiseWithRebalance) {
  RunFourDaemonsFourTrainers("highest");
}

// bf16 Newton–Schulz end to end: the daemons' bf16 exchanges and in-place
// bf16 NS output land on the bits of the single-process bf16 reference.
TEST(SystemTest, MediumPrecisionFourDaemonsBitwiseWithRebalance) {
  RunFourDaemonsFourTrainers("medium");
}

// A medium and a highest group on one domain share a lane and its raw-byte
// exchange buffers (bf16 and fp32 pieces in turn); both stay bitwise.
TEST(SystemTest, MediumAndHighestGroupsOnOneDomainBitwise) {
  RunFourDaemonsFourTrainers("medium", "highest");
}

#endif  // MUOND_SYSTEM_TEST_CUDA

}  // namespace
