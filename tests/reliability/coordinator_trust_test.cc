// The coordinator trusts nobody, through real processes (a
// muond-coordinator and four muond daemons, 2x2 host mode, loopback).
//  * Ranks registering one group with different hyperparameters (here
//    fp32_matmul_prec, which used to SIGABRT every daemon in a Gloo size
//    enforce at the first step) are refused at registration, on the later
//    rank, with the group, the field and both values; no daemon dies, and the
//    job steps once every rank registers again with agreeing values (a
//    refusal refuses the registration round).
//  * Tokens from a 0600 file: the servers and muonctl take --token_file, the
//    token never appears on a command line (ps), muonctl without it is
//    refused, and unsafe or empty token files are refused at start naming the
//    flag.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/reliability/harness.h"

namespace muond::reliability {
namespace {

constexpr char kToken[] = "s3cret-token-for-the-trust-test";

std::string Cmdline(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/cmdline"));
  std::string raw(std::istreambuf_iterator<char>(in), {});
  return absl::StrReplaceAll(raw, {{std::string(1, '\0'), " "}});
}

std::unique_ptr<Client> ConnectRank(const Cluster& cluster, int rank) {
  ClientOptions options;
  options.job_id = cluster.job();
  options.client_id = absl::StrCat("trust", rank);
  options.rpc_timeout = absl::Seconds(20);
  auto client = Client::Connect("unix://" + cluster.socket(rank), options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

TEST(CoordinatorTrust, MismatchedMatmulPrecisionRefusedAtRegistration) {
  Cluster cluster({.daemon_flags = {"--comm_timeout_s=5"}});
  cluster.StartAll();
  Trainers trainers(cluster);
  std::vector<std::unique_ptr<Client>> clients;
  for (int r = 0; r < kWorld; ++r) clients.push_back(ConnectRank(cluster, r));
  auto group = [&](int rank, v1::MatmulPrecision prec) {
    v1::ParamGroup g = trainers.Group(rank);
    g.mutable_muon()->set_fp32_matmul_prec(prec);
    return g;
  };
  // Ranks 0, 2, 3 publish first; rank 1 disagrees and is refused.
  std::vector<std::thread> first;
  for (int r : {0, 2, 3}) {
    first.emplace_back([&, r] {
      EXPECT_TRUE(clients[r]
                      ->Register({trainers.Region(r)},
                                 {group(r, v1::MATMUL_PRECISION_HIGHEST)})
                      .ok());
    });
  }
  for (auto& t : first) t.join();
  absl::StatusOr<v1::RegisterParamsResponse> refused = clients[1]->Register(
      {trainers.Region(1)}, {group(1, v1::MATMUL_PRECISION_MEDIUM)});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("fp32_matmul_prec"), std::string::npos) << message;
  EXPECT_NE(message.find("MATMUL_PRECISION_HIGHEST"), std::string::npos)
      << message;
  EXPECT_NE(message.find("rank 1 has MATMUL_PRECISION_MEDIUM"),
            std::string::npos)
      << message;
  // The refusal refused the round: the job recovers once every rank
  // registers again (the refused rank first: it used to complete the round
  // with its peers' old registrations and build a plan they never used, its
  // Gloo rendezvous timing out), and steps; no daemon crashed.
  for (int r : {0, 2, 3}) ASSERT_TRUE(clients[r]->Unregister().ok()) << r;
  for (int r : {1, 0, 2, 3}) {
    ASSERT_TRUE(clients[r]
                    ->Register({trainers.Region(r)},
                               {group(r, v1::MATMUL_PRECISION_HIGHEST)})
                    .ok())
        << r;
  }
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(clients[r]->WaitForPlan(absl::Seconds(30)).ok()) << r;
  }
  trainers.FillGrads(1);
  std::vector<absl::StatusOr<v1::StepResponse>> steps(kWorld);
  std::vector<std::thread> stepping;
  for (int r = 0; r < kWorld; ++r) {
    stepping.emplace_back([&, r] { steps[r] = clients[r]->Step(1); });
  }
  for (auto& t : stepping) t.join();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(steps[r].ok()) << r << ": " << steps[r].status();
    EXPECT_TRUE(cluster.DaemonAlive(r)) << r;
  }
}

// Without the check the same registration was accepted and the first step
// aborted every daemon: make sure a step after a refused registration does
// not reach the communicators (the refused rank has no registration).
TEST(CoordinatorTrust, RefusedRankCannotStep) {
  Cluster cluster({.daemon_flags = {"--comm_timeout_s=5"}});
  cluster.StartAll();
  Trainers trainers(cluster);
  auto client = ConnectRank(cluster, 0);
  ASSERT_TRUE(client->Register({trainers.Region(0)}, {trainers.Group(0)}).ok());
  auto late = ConnectRank(cluster, 1);
  v1::ParamGroup g = trainers.Group(1);
  g.mutable_muon()->set_num_ns_steps(3);
  absl::StatusOr<v1::RegisterParamsResponse> refused =
      late->Register({trainers.Region(1)}, {g});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("num_ns_steps"), std::string::npos)
      << refused.status();
  EXPECT_FALSE(late->Step(1).ok());
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(cluster.DaemonAlive(r)) << r;
}

TEST(CoordinatorTrust, TokenFromFileNeverOnTheCommandLine) {
  Cluster cluster({.token = kToken, .token_in_file = true});
  cluster.StartAll();
  Trainers trainers(cluster);
  ASSERT_TRUE(trainers.RegisterAll().ok());
  ASSERT_TRUE(trainers.RunSteps(1, 2).ok());
  ASSERT_TRUE(cluster.WaitDaemonsLive(true, absl::Seconds(10)));
  // ps shows no token, only the file.
  for (pid_t pid : {cluster.coordinator_pid(), cluster.daemon_pid(0),
                    cluster.daemon_pid(3)}) {
    const std::string cmdline = Cmdline(pid);
    EXPECT_EQ(cmdline.find(kToken), std::string::npos) << cmdline;
    EXPECT_NE(cmdline.find("--token_file="), std::string::npos) << cmdline;
  }
  // muonctl: with the file it is let in, without a token it is refused.
  const std::string muonctl = Runfile("tools/muonctl/muonctl");
  std::string out;
  EXPECT_EQ(RunTool({muonctl, "daemons", "--coordinator", cluster.coordinator(),
                     "--job_id", cluster.job(), "--token-file",
                     cluster.dir() + "/token"},
                    &out),
            0)
      << out;
  EXPECT_NE(out.find("live"), std::string::npos) << out;
  EXPECT_NE(RunTool({muonctl, "daemons", "--coordinator", cluster.coordinator(),
                     "--job_id", cluster.job()},
                    &out),
            0)
      << out;
  EXPECT_NE(out.find("token"), std::string::npos) << out;
}

// Writes `content` to dir/name with `mode`; returns the path.
std::string WriteFile(const std::string& dir, const std::string& name,
                      const std::string& content, mode_t mode) {
  const std::string path = dir + "/" + name;
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(write(fd, content.data(), content.size()), ssize_t(content.size()));
  fchmod(fd, mode);
  close(fd);
  return path;
}

TEST(CoordinatorTrust, UnsafeOrEmptyTokenFilesAreRefusedAtStart) {
  Cluster cluster({});
  const std::string dir = cluster.dir();
  struct Case {
    std::string file;
    std::string want;
  };
  const std::vector<Case> cases = {
      {WriteFile(dir, "open", "abc\n", 0644), "readable or writable by other"},
      {WriteFile(dir, "empty", "\n", 0600), "empty"},
      {WriteFile(dir, "spaces", "a b\n", 0600), "printable ASCII"},
      {dir + "/missing", "cannot open"},
      {dir, "not a regular file"},
  };
  const std::string muonctl = Runfile("tools/muonctl/muonctl");
  for (const Case& c : cases) {
    for (const std::vector<std::string>& args :
         std::vector<std::vector<std::string>>{
             {Runfile("server/coordinator/muond-coordinator"),
              "--listen=127.0.0.1:0", "--token_file=" + c.file},
             {Runfile("server/daemon/muond-daemon"), "--host",
              "--coordinator=127.0.0.1:1", "--job_id=j", "--rank=0",
              "--world_size=1", "--listen=unix://" + dir + "/x.sock",
              "--token_file=" + c.file},
             {muonctl, "status", "--coordinator", "127.0.0.1:1", "--job_id",
              "j", "--token-file", c.file}}) {
      std::string out;
      EXPECT_EQ(RunTool(args, &out), 2) << args[0] << " " << c.file << out;
      EXPECT_NE(out.find("--token_file"), std::string::npos) << out;
      EXPECT_NE(out.find(c.want), std::string::npos) << c.want << ": " << out;
    }
  }
  // --token and --token_file together: one of them.
  std::string out;
  EXPECT_EQ(RunTool({Runfile("server/coordinator/muond-coordinator"),
                     "--listen=127.0.0.1:0", "--token=x",
                     "--token_file=" + WriteFile(dir, "ok", "abc\n", 0600)},
                    &out),
            2);
  EXPECT_NE(out.find("give one of them"), std::string::npos) << out;
}

TEST(CoordinatorTrust, BadCoordinatorFlagsRefusedNamingTheFlag) {
  const std::string bin = Runfile("server/coordinator/muond-coordinator");
  for (const auto& [flag, name] :
       std::vector<std::pair<std::string, std::string>>{
           {"--rebalance_activate_margin=-1", "rebalance_activate_margin"},
           {"--rebalance_threshold=nan", "rebalance_threshold"},
           {"--rebalance_threshold=-2", "rebalance_threshold"},
           {"--rebalance_interval_steps=0", "rebalance_interval_steps"},
           {"--job_idle_expiry_s=-5", "job_idle_expiry_s"},
           {"--kv_max_value_bytes=0", "kv_max_value_bytes"}}) {
    std::string out;
    EXPECT_EQ(RunTool({bin, "--listen=127.0.0.1:0", flag}, &out), 2) << flag;
    EXPECT_NE(out.find("--" + name), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace muond::reliability
