// muond::Client through a real host daemon's step channel (one
// muond-coordinator, one `muond-daemon --host` per job). Steps through the
// channel give the same answers and params as steps over the Step RPC,
// bitwise; a refusal carries the same code, message and ErrorReason; a
// daemon without channels leaves the client on gRPC; a request or answer
// too large for the channel goes over gRPC; a passed deadline or a daemon
// killed mid-wait breaks the channel (the daemon's death is noticed by its
// lock, not at the deadline); a forked child lets go of its copy. Which way a
// step went is read from the channel's own request_seq, through the client's
// mapping of it.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/cpp/client.h"
#include "client/cpp/shm_region.h"
#include "core/common/error_reason.h"
#include "proto/step_channel_layout.h"
#include "tests/common/files.h"
#include "tests/common/muon_group.h"
#include "tests/common/spawn.h"

namespace muond {
namespace {

namespace sc = step_channel;
using ::testing::HasSubstr;

constexpr int64_t kRows = 8, kCols = 4;

// The step channel of `job` as the client maps it (its writable mapping of
// the unlinked object, found in /proc/self/maps), or nullopt when none is
// mapped.
std::optional<const char*> ChannelMapping(const std::string& job) {
  std::ifstream maps("/proc/self/maps");
  const std::string name = absl::StrCat("/dev/shm/muond-", job, "-");
  for (std::string line; std::getline(maps, line);) {
    // "start-end perms ...": the client maps it read-write.
    const size_t perms = line.find(' ') + 1;
    if (line.find(name) == std::string::npos ||
        line.compare(perms, 2, "rw") != 0) {
      continue;
    }
    return reinterpret_cast<const char*>(std::stoull(line, nullptr, 16));
  }
  return std::nullopt;
}

uint32_t WordOf(const char* channel, uint64_t offset) {
  return __atomic_load_n(reinterpret_cast<const uint32_t*>(channel + offset),
                         __ATOMIC_ACQUIRE);
}

// Requests posted through `job`'s channel so far; -1 without one.
int64_t ChannelRequests(const std::string& job) {
  std::optional<const char*> channel = ChannelMapping(job);
  if (!channel) return -1;
  return WordOf(*channel, sc::kRequestSeqOffset);
}

// A read-only view of `job`'s channel header of this test's own (the
// object reopened through the client's descriptor in /proc/self/fd): it
// stays valid while the client unmaps its channel.
class HeaderView {
 public:
  explicit HeaderView(const std::string& job) {
    const std::string prefix = absl::StrCat("/dev/shm/muond-", job, "-");
    for (const auto& entry :
         std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code error;
      const std::string target =
          std::filesystem::read_symlink(entry.path(), error).string();
      if (error || target.rfind(prefix, 0) != 0) continue;
      const int fd = open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      void* base = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
      close(fd);
      if (base != MAP_FAILED) base_ = static_cast<const char*>(base);
      return;
    }
  }
  ~HeaderView() {
    if (base_ != nullptr) munmap(const_cast<char*>(base_), 4096);
  }
  bool ok() const { return base_ != nullptr; }
  uint32_t Word(uint64_t offset) const { return WordOf(base_, offset); }

 private:
  const char* base_ = nullptr;
};

bool ProcessStopped(pid_t pid) {
  const std::string stat =
      testing::ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && stat.substr(paren + 2, 1) == "T";
}

// One trainer: `count` kRows x kCols fp32 params and grads in one shm
// region, registered as one Muon group.
struct Trainer {
  std::unique_ptr<ShmRegion> region;
  std::vector<float*> params, grads;
  std::vector<std::string> names;
  v1::ParamGroup group;  // as registered
  std::unique_ptr<Client> client;

  void SetGrads(int step, bool nonfinite = false) {
    for (size_t p = 0; p < grads.size(); ++p) {
      for (int64_t k = 0; k < kRows * kCols; ++k) {
        grads[p][k] =
            nonfinite ? NAN : float((k * 7 + p * 13 + step * 5) % 17 - 8) / 8;
      }
    }
  }
  std::vector<float> Params() const {
    std::vector<float> all;
    for (const float* p : params) all.insert(all.end(), p, p + kRows * kCols);
    return all;
  }
};

class StepChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/muond-cct-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    const pid_t coordinator =
        Start({testing::Runfile("server/coordinator/muond-coordinator"),
               "--listen=127.0.0.1:0", "--port_file=" + dir_ + "/port"},
              "coordinator");
    ASSERT_GT(coordinator, 0);
    ASSERT_TRUE(testing::WaitForFile(dir_ + "/port", absl::Seconds(20)));
    int port = 0;
    std::ifstream(dir_ + "/port") >> port;
    ASSERT_GT(port, 0);
    coordinator_ = absl::StrCat("127.0.0.1:", port);
  }

  void TearDown() override {
    for (pid_t pid : servers_) {
      kill(pid, SIGTERM);
      kill(pid, SIGCONT);  // a daemon a failed test left stopped
    }
    for (pid_t pid : servers_) WaitOrKill(pid);
    if (HasFailure()) {
      for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
        if (entry.path().extension() != ".log") continue;
        const std::string log = testing::ReadFile(entry.path());
        std::fprintf(
            stderr, "---- %s ----\n%s\n", entry.path().c_str(),
            log.substr(log.size() > 4000 ? log.size() - 4000 : 0).c_str());
      }
    }
    std::filesystem::remove_all(dir_);
  }

  pid_t Start(const std::vector<std::string>& args, const std::string& log) {
    const pid_t pid =
        testing::Spawn(args, dir_ + "/" + log + ".log", /*truncate=*/true);
    if (pid > 0) servers_.push_back(pid);
    return pid;
  }

  static void WaitOrKill(pid_t pid) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  // A daemon of its own job `job` (rank 0 of 1, host mode); its address.
  std::string StartDaemon(const std::string& job,
                          const std::vector<std::string>& extra = {}) {
    const std::string socket = dir_ + "/" + job + ".sock";
    std::vector<std::string> args = {
        testing::Runfile("server/daemon/muond-daemon"),
        "--host",
        "--coordinator=" + coordinator_,
        "--job_id=" + job,
        "--rank=0",
        "--world_size=1",
        "--listen=unix://" + socket,
        "--comm_timeout_s=30",
        "--coordinator_timeout_s=20"};
    args.insert(args.end(), extra.begin(), extra.end());
    daemon_pid_ = Start(args, job);
    EXPECT_GT(daemon_pid_, 0);
    EXPECT_TRUE(testing::WaitForFile(socket, absl::Seconds(20))) << socket;
    return "unix://" + socket;
  }

  // A trainer of `count` params (names `name_bytes` long at least)
  // registered with the daemon at `address`, its plan there.
  std::unique_ptr<Trainer> Register(const std::string& address,
                                    ClientOptions options, int count = 3,
                                    size_t name_bytes = 0) {
    auto trainer = std::make_unique<Trainer>();
    const size_t matrix = kRows * kCols * sizeof(float);
    auto region = ShmRegion::Create(
        absl::StrCat("/muond-cct-region-", getpid(), "-", regions_++),
        count * 2 * (matrix + 256));
    EXPECT_TRUE(region.ok()) << region.status();
    if (!region.ok()) return nullptr;
    trainer->region = *std::move(region);
    v1::ParamGroup group = testing::DenseMuonGroup(1, 1, 0, 0);
    for (int p = 0; p < count; ++p) {
      float* param =
          static_cast<float*>(*trainer->region->Allocate(matrix, 256));
      float* grad =
          static_cast<float*>(*trainer->region->Allocate(matrix, 256));
      for (int64_t k = 0; k < kRows * kCols; ++k) {
        param[k] = float((k * 3 + p * 11) % 19 - 9) / 9;
      }
      std::string name = absl::StrCat("w", p, "-");
      name.resize(std::max(name.size(), name_bytes), 'x');
      *group.add_params() = MakeParam(
          name, {kRows, kCols},
          *HostRef(*trainer->region, param, v1::DTYPE_FP32, {kRows, kCols}),
          *HostRef(*trainer->region, grad, v1::DTYPE_FP32, {kRows, kCols}));
      trainer->params.push_back(param);
      trainer->grads.push_back(grad);
      trainer->names.push_back(name);
    }
    auto client = Client::Connect(address, std::move(options));
    EXPECT_TRUE(client.ok()) << client.status();
    if (!client.ok()) return nullptr;
    trainer->client = *std::move(client);
    trainer->group = group;
    const absl::Status registered =
        trainer->client->Register({HostRegion(*trainer->region)}, {group})
            .status();
    EXPECT_TRUE(registered.ok()) << registered;
    const absl::Status planned =
        trainer->client->WaitForPlan(absl::Seconds(60));
    EXPECT_TRUE(planned.ok()) << planned;
    if (!registered.ok() || !planned.ok()) return nullptr;
    return trainer;
  }

  // SIGSTOP to the daemon, returning once it is stopped.
  void StopDaemon() {
    ASSERT_EQ(kill(daemon_pid_, SIGSTOP), 0);
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (!ProcessStopped(daemon_pid_) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_TRUE(ProcessStopped(daemon_pid_));
  }

  static ClientOptions Options(const std::string& job, bool step_channel) {
    ClientOptions options;
    options.job_id = job;
    options.client_id = absl::StrCat("trainer-", job);
    options.rpc_timeout = absl::Seconds(120);
    options.step_channel = step_channel;
    return options;
  }

  std::string dir_;
  std::string coordinator_;
  std::vector<pid_t> servers_;
  pid_t daemon_pid_ = -1;
  int regions_ = 0;
};

// The same three steps on three daemons, a trainer over the Step RPC, one
// through the channel asleep till each answer and one polling for it
// (ClientOptions.step_channel_poll of 10 ms, each step held ~30 ms by
// stopping the daemon: steps 2 and 3 poll from ~20 ms, and the answer comes
// in the poll): the same answers and, bitwise, the same params.
TEST_F(StepChannelTest, StepsThroughTheChannelEqualStepsOverGrpc) {
  std::vector<float> params[3];
  std::vector<v1::StepResponse> answers[3];
  for (const int way : {1, 2, 0}) {  // 0: the Step RPC; 1: asleep; 2: polling
    const bool channel = way > 0;
    const std::string job =
        absl::StrCat(channel ? "chan" : "rpc", way, "-", getpid());
    ClientOptions options = Options(job, channel);
    options.step_channel_poll =
        way == 2 ? absl::Milliseconds(10) : absl::ZeroDuration();
    std::unique_ptr<Trainer> trainer = Register(StartDaemon(job), options);
    ASSERT_NE(trainer, nullptr);
    EXPECT_EQ(trainer->client->HasStepChannel(), channel);
    EXPECT_EQ(trainer->client->StepChannelStatus().ok(), channel)
        << trainer->client->StepChannelStatus();
    const std::vector<float> before = trainer->Params();
    for (int step = 1; step <= 3; ++step) {
      trainer->SetGrads(step);
      std::thread resume;
      if (way == 2) {  // a step as long as a GPU's
        ASSERT_NO_FATAL_FAILURE(StopDaemon());
        resume = std::thread([this] {
          absl::SleepFor(absl::Milliseconds(30));
          kill(daemon_pid_, SIGCONT);
        });
      }
      absl::StatusOr<v1::StepResponse> answer = trainer->client->Step(step);
      if (resume.joinable()) resume.join();
      ASSERT_TRUE(answer.ok()) << answer.status();
      answers[way].push_back(*answer);
    }
    EXPECT_EQ(ChannelRequests(job), channel ? 3 : -1);
    if (way == 2) {
      EXPECT_GE(trainer->client->StepChannelAnswerPolls(), 1);
    } else {
      EXPECT_EQ(trainer->client->StepChannelAnswerPolls(), 0);
    }
    params[way] = trainer->Params();
    EXPECT_NE(params[way], before);
  }
  for (const int way : {1, 2}) {
    for (int i = 0; i < 3; ++i) {
      const v1::StepResponse &through = answers[way][i], &rpc = answers[0][i];
      EXPECT_EQ(through.step_id(), i + 1);
      EXPECT_EQ(through.step_id(), rpc.step_id());
      EXPECT_EQ(through.plan_version(), rpc.plan_version());
      EXPECT_EQ(through.replayed(), rpc.replayed());
      EXPECT_GT(through.timings().total_us(), 0);
      // Stamped through the channel only, on one clock.
      EXPECT_GT(through.timings().received_at_us(), 0);
      EXPECT_LE(through.timings().received_at_us(),
                through.timings().answered_at_us());
      EXPECT_EQ(rpc.timings().received_at_us(), 0);
    }
    ASSERT_EQ(params[0].size(), params[way].size());
    EXPECT_EQ(std::memcmp(params[0].data(), params[way].data(),
                          params[0].size() * sizeof(float)),
              0)
        << "way " << way;
  }
}

// A trainer's refusal answered through the channel is the one the Step RPC
// gives (a second client of the same registration, without a channel):
// code, message, ErrorReason and its metadata; nothing changes.
TEST_F(StepChannelTest, ARefusalThroughTheChannelEqualsOneOverGrpc) {
  const std::string job = absl::StrCat("refuse", getpid());
  const std::string address = StartDaemon(job);
  std::unique_ptr<Trainer> trainer = Register(address, Options(job, true));
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(trainer->client->HasStepChannel());
  auto rpc = Client::Connect(address, Options(job, false));
  ASSERT_TRUE(rpc.ok());
  trainer->SetGrads(1);
  const std::vector<float> before = trainer->Params();
  const std::string why = "grad of w1 has shape [3, 4], expected [8, 4]";
  const absl::Status through = trainer->client->RefuseStep(1, why);
  EXPECT_EQ(ChannelRequests(job), 1);
  const absl::Status over_grpc = (*rpc)->RefuseStep(1, why);
  EXPECT_EQ(ChannelRequests(job), 1);
  EXPECT_EQ(through.code(), absl::StatusCode::kFailedPrecondition) << through;
  EXPECT_TRUE(HasErrorReason(through, ErrorReason::kTrainerRefused));
  EXPECT_THAT(through.message(), HasSubstr(why));
  EXPECT_EQ(through.code(), over_grpc.code());
  EXPECT_EQ(through.message(), over_grpc.message());
  EXPECT_EQ(GetErrorReason(through), GetErrorReason(over_grpc));
  EXPECT_EQ(GetErrorMetadata(through), GetErrorMetadata(over_grpc));
  EXPECT_EQ(trainer->Params(), before);
  // The step id is free again; the channel stays.
  absl::StatusOr<v1::StepResponse> applied = trainer->client->Step(1);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_FALSE(applied->replayed());
  EXPECT_EQ(ChannelRequests(job), 2);
  EXPECT_NE(trainer->Params(), before);
  EXPECT_TRUE(trainer->client->HasStepChannel());
}

// Bytes that are not UTF-8 in a refusal's reason or an override's group
// (proto strings: the daemon could not parse the request) get the same
// answer through the channel as over the Step RPC: the reason escaped and
// the job refused; the override InvalidArgument naming it, the job refused
// too (so no peer waits for its comm timeout). The step id stays free.
TEST_F(StepChannelTest, BytesThatAreNotUtf8AreAnsweredAlikeBothWays) {
  const std::string job = absl::StrCat("utf", getpid());
  const std::string address = StartDaemon(job);
  std::unique_ptr<Trainer> trainer = Register(address, Options(job, true));
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(trainer->client->HasStepChannel());
  auto rpc = Client::Connect(address, Options(job, false));
  ASSERT_TRUE(rpc.ok());
  trainer->SetGrads(1);
  const std::vector<float> before = trainer->Params();
  const std::string why = "grad of w\xff has shape [3, 4]";
  const absl::Status through = trainer->client->RefuseStep(1, why);
  const absl::Status over_grpc = (*rpc)->RefuseStep(1, why);
  EXPECT_EQ(ChannelRequests(job), 1);
  EXPECT_EQ(through.code(), absl::StatusCode::kFailedPrecondition) << through;
  EXPECT_TRUE(HasErrorReason(through, ErrorReason::kTrainerRefused));
  EXPECT_THAT(through.message(), HasSubstr("xff has shape [3, 4]"));
  EXPECT_EQ(through.message(), over_grpc.message());
  EXPECT_EQ(GetErrorReason(through), GetErrorReason(over_grpc));
  EXPECT_EQ(GetErrorMetadata(through), GetErrorMetadata(over_grpc));

  v1::GroupOverride bad;
  bad.set_group("mu\xfeon");
  bad.set_lr(0.1);
  const absl::Status bad_through = trainer->client->Step(1, {bad}).status();
  const absl::Status bad_grpc = (*rpc)->Step(1, {bad}).status();
  EXPECT_EQ(ChannelRequests(job), 2);  // its refusal
  EXPECT_EQ(bad_through.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_through.message(),
              HasSubstr("overrides: group 'mu\\xfeon' is not valid UTF-8"));
  EXPECT_EQ(bad_through, bad_grpc);
  EXPECT_EQ(trainer->Params(), before);
  absl::StatusOr<v1::StepResponse> applied = trainer->client->Step(1);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_FALSE(applied->replayed());
  EXPECT_EQ(ChannelRequests(job), 3);
  EXPECT_TRUE(trainer->client->HasStepChannel());
}

// A daemon with channels off: the client is told why and steps over gRPC;
// no shm name of the job is left behind.
TEST_F(StepChannelTest, ADaemonWithoutChannelsLeavesStepsOnGrpc) {
  const std::string job = absl::StrCat("nochan", getpid());
  std::unique_ptr<Trainer> trainer =
      Register(StartDaemon(job, {"--max_step_channels=0"}), Options(job, true));
  ASSERT_NE(trainer, nullptr);
  EXPECT_FALSE(trainer->client->HasStepChannel());
  const absl::Status why = trainer->client->StepChannelStatus();
  EXPECT_EQ(why.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(why.message(), HasSubstr("--max_step_channels=0"));
  EXPECT_EQ(ChannelMapping(job), std::nullopt);
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_NE(entry.path().filename().string().rfind("muond-" + job + "-", 0),
              0u)
        << entry.path();
  }
  const std::vector<float> before = trainer->Params();
  for (int step = 1; step <= 2; ++step) {
    trainer->SetGrads(step);
    absl::StatusOr<v1::StepResponse> answer = trainer->client->Step(step);
    ASSERT_TRUE(answer.ok()) << answer.status();
    EXPECT_EQ(answer->step_id(), step);
  }
  EXPECT_NE(trainer->Params(), before);
}

// Long param names and NaN grads on a --skip_nonfinite daemon: the answer
// (every name in skipped_nonfinite) is past a 64 KiB response area, so it
// is fetched over gRPC: the daemon keeps it for the Step RPC of the same
// request, which returns it as it was (a replay stays a replay); a refusal
// past a 64 KiB request area is not sent through the channel at all.
TEST_F(StepChannelTest, TooLargeRequestsAndAnswersGoOverGrpc) {
  const std::string job = absl::StrCat("large", getpid());
  ClientOptions options = Options(job, true);
  options.step_channel_request_bytes = sc::kMinCapacity;
  options.step_channel_response_bytes = sc::kMinCapacity;
  std::unique_ptr<Trainer> trainer =
      Register(StartDaemon(job, {"--skip_nonfinite"}), options, 100, 900);
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(trainer->client->HasStepChannel());
  const std::vector<float> before = trainer->Params();
  trainer->SetGrads(1, /*nonfinite=*/true);
  absl::StatusOr<v1::StepResponse> skipped = trainer->client->Step(1);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  const char* channel = *ChannelMapping(job);
  EXPECT_EQ(WordOf(channel, sc::kRequestSeqOffset), 1u);
  EXPECT_EQ(WordOf(channel, sc::kResponseKindOffset), sc::kTooLarge);
  EXPECT_GT(WordOf(channel, sc::kResponseLenOffset), sc::kMinCapacity);
  EXPECT_EQ(skipped->step_id(), 1);
  // The daemon's answer to this very request, kept for the RPC: not its
  // record of the step (a replay, handled in no time, which in a job of
  // several ranks would vote with ranks that are past it).
  EXPECT_FALSE(skipped->replayed());
  EXPECT_GT(skipped->timings().handler_us(), 0);
  std::vector<std::string> names;  // as the daemon names them
  for (const std::string& name : trainer->names)
    names.push_back("muon/" + name);
  EXPECT_THAT(skipped->skipped_nonfinite(),
              ::testing::UnorderedElementsAreArray(names));
  EXPECT_EQ(trainer->Params(), before);
  EXPECT_TRUE(trainer->client->HasStepChannel());
  // Step 1 again: a replay, as over the Step RPC.
  absl::StatusOr<v1::StepResponse> again = trainer->client->Step(1);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(WordOf(channel, sc::kRequestSeqOffset), 2u);
  EXPECT_EQ(WordOf(channel, sc::kResponseKindOffset), sc::kTooLarge);
  EXPECT_TRUE(again->replayed());
  EXPECT_THAT(again->skipped_nonfinite(),
              ::testing::UnorderedElementsAreArray(names));

  const std::string long_why(sc::kMinCapacity + 100, 'y');
  const absl::Status refused = trainer->client->RefuseStep(2, long_why);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(HasErrorReason(refused, ErrorReason::kTrainerRefused));
  EXPECT_EQ(ChannelRequests(job), 2);  // not through the channel
  trainer->SetGrads(2);
  ASSERT_TRUE(trainer->client->Step(2).ok());
  EXPECT_EQ(ChannelRequests(job), 3);
  EXPECT_NE(trainer->Params(), before);
}

// A step whose answer does not come by rpc_timeout (the daemon stopped) is
// DeadlineExceeded, and the channel is never used again: the daemon, once
// continued, applied it, so the same step over gRPC is its replay.
TEST_F(StepChannelTest, APassedDeadlineBreaksTheChannel) {
  const std::string job = absl::StrCat("late", getpid());
  ClientOptions options = Options(job, true);
  options.rpc_timeout = absl::Seconds(2);
  std::unique_ptr<Trainer> trainer = Register(StartDaemon(job), options);
  ASSERT_NE(trainer, nullptr);
  trainer->SetGrads(1);
  ASSERT_TRUE(trainer->client->Step(1).ok());
  ASSERT_EQ(ChannelRequests(job), 1);
  ASSERT_NO_FATAL_FAILURE(StopDaemon());
  trainer->SetGrads(2);
  const absl::Status late = trainer->client->Step(2).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_FALSE(trainer->client->HasStepChannel());
  EXPECT_THAT(trainer->client->StepChannelStatus().message(),
              HasSubstr("DEADLINE_EXCEEDED"));
  EXPECT_EQ(ChannelMapping(job), std::nullopt);
  ASSERT_EQ(kill(daemon_pid_, SIGCONT), 0);
  // The daemon's channel thread applies the posted step 2 first.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::StatusOr<v1::GetStatusResponse> status;
  do {
    status = trainer->client->Status();
  } while ((!status.ok() || status->last_step_id() != 2) &&
           absl::Now() < deadline);
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->last_step_id(), 2);
  absl::StatusOr<v1::StepResponse> again = trainer->client->Step(2);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed());
}

// A forked child lets go of its copy of the channel at once (its
// descriptor would keep the trainer's lock past the parent's death) and
// neither unlocks nor closes it for the parent, whose steps go on through it.
TEST_F(StepChannelTest, AForkedChildLetsGoOfTheChannel) {
  const std::string job = absl::StrCat("fork", getpid());
  std::unique_ptr<Trainer> trainer =
      Register(StartDaemon(job), Options(job, true));
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(
      testing::HoldsDescriptorOf(absl::StrCat("/dev/shm/muond-", job, "-")));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const bool let_go = !testing::HoldsDescriptorOf(
                            absl::StrCat("/dev/shm/muond-", job, "-")) &&
                        !ChannelMapping(job).has_value();
    _exit(let_go ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(
      testing::HoldsDescriptorOf(absl::StrCat("/dev/shm/muond-", job, "-")));
  for (int step = 1; step <= 2; ++step) {
    trainer->SetGrads(step);
    ASSERT_TRUE(trainer->client->Step(step).ok());
  }
  EXPECT_EQ(ChannelRequests(job), 2);
  EXPECT_TRUE(trainer->client->HasStepChannel());
}

// A forked child may destroy its copy of the Client: the copy's gRPC
// channel is left to the child's exit (destroying it waited forever for
// gRPC's threads, which are the parent's), its step channel let go at the
// fork; the parent steps on through its channel.
TEST_F(StepChannelTest, AForkedChildDestroysItsCopyOfTheClient) {
  const std::string job = absl::StrCat("forkdel", getpid());
  std::unique_ptr<Trainer> trainer =
      Register(StartDaemon(job), Options(job, true));
  ASSERT_NE(trainer, nullptr);
  trainer->SetGrads(1);
  ASSERT_TRUE(trainer->client->Step(1).ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(30);  // a hung destructor ends the child with SIGALRM
    trainer->client.reset();
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "child status " << status;
  trainer->SetGrads(2);
  ASSERT_TRUE(trainer->client->Step(2).ok());
  EXPECT_EQ(ChannelRequests(job), 2);
  EXPECT_TRUE(trainer->client->HasStepChannel());
}

// SIGKILL of the daemon while the client waits for the channel's answer:
// the daemon is stopped first, so the request is posted and unanswered when
// it dies. The deadline is far away, so only the daemon's released lock can
// end the wait: Unavailable naming the address, the channel dropped.
// Asleep on the futex and polling (10 us: step 2 polls around when step 1's
// wait says, while the daemon is stopped; the lock is looked at after the
// poll, as after a slice).
class KilledMidWaitTest : public StepChannelTest,
                          public ::testing::WithParamInterface<absl::Duration> {
};

TEST_P(KilledMidWaitTest, ADaemonKilledMidWaitIsUnavailableNotAHang) {
  const std::string job = absl::StrCat("kill", getpid());
  const std::string address = StartDaemon(job);
  ClientOptions options = Options(job, true);
  options.step_channel_poll = GetParam();
  std::unique_ptr<Trainer> trainer = Register(address, options);
  ASSERT_NE(trainer, nullptr);
  trainer->SetGrads(1);
  ASSERT_TRUE(trainer->client->Step(1).ok());
  const HeaderView channel(job);
  ASSERT_TRUE(channel.ok());
  ASSERT_NO_FATAL_FAILURE(StopDaemon());
  trainer->SetGrads(2);
  absl::Status result;
  absl::Duration waited;
  std::thread step([&] {
    const absl::Time start = absl::Now();
    result = trainer->client->Step(2).status();
    waited = absl::Now() - start;
  });
  // Posted, then the daemon dies.
  const absl::Time post_deadline = absl::Now() + absl::Seconds(20);
  while (channel.Word(sc::kRequestSeqOffset) != 2 &&
         absl::Now() < post_deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(channel.Word(sc::kRequestSeqOffset), 2u);
  ASSERT_EQ(kill(daemon_pid_, SIGKILL), 0);
  step.join();
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  EXPECT_THAT(result.message(),
              HasSubstr("daemon at " + address + " is unreachable: "));
  EXPECT_THAT(result.message(), HasSubstr("lock is gone"));
  EXPECT_EQ(GetErrorReason(result), ErrorReason::kUnspecified);
  // Far below rpc_timeout (120 s): only the lock ended the wait.
  EXPECT_LT(waited, absl::Seconds(60));
  std::fprintf(stderr, "Unavailable %s after the step was sent\n",
               absl::FormatDuration(waited).c_str());
  EXPECT_FALSE(trainer->client->HasStepChannel());
  EXPECT_EQ(ChannelMapping(job), std::nullopt);
  // Later steps go over gRPC, to the same verdict.
  const absl::Status next = trainer->client->Step(2).status();
  EXPECT_EQ(next.code(), absl::StatusCode::kUnavailable) << next;
  EXPECT_THAT(next.message(), HasSubstr("daemon at " + address));
}

INSTANTIATE_TEST_SUITE_P(AsleepAndPolling, KilledMidWaitTest,
                         ::testing::Values(absl::ZeroDuration(),
                                           absl::Microseconds(10)));

void IgnoreSignal(int) {}

// As above, with the waiting thread interrupted by a signal every 20 ms (a
// profiler's SIGPROF, a timer): each interrupted wait checks the daemon's
// lock too, so its death is still noticed long before rpc_timeout (before:
// only a wait that ran a whole 0.5 s slice looked, so the step waited for
// its deadline).
TEST_F(StepChannelTest, ADaemonKilledMidWaitIsNoticedDespiteSignals) {
  const std::string job = absl::StrCat("sigs", getpid());
  const std::string address = StartDaemon(job);
  ClientOptions options = Options(job, true);
  options.rpc_timeout = absl::Seconds(40);
  std::unique_ptr<Trainer> trainer = Register(address, options);
  ASSERT_NE(trainer, nullptr);
  trainer->SetGrads(1);
  ASSERT_TRUE(trainer->client->Step(1).ok());
  const HeaderView channel(job);
  ASSERT_TRUE(channel.ok());
  struct sigaction action = {}, previous = {};
  action.sa_handler = IgnoreSignal;  // no SA_RESTART: the futex wait ends
  ASSERT_EQ(sigaction(SIGUSR1, &action, &previous), 0);
  ASSERT_NO_FATAL_FAILURE(StopDaemon());
  trainer->SetGrads(2);
  std::atomic<bool> done{false};
  absl::Status result;
  absl::Duration waited;
  std::thread step([&] {
    const absl::Time start = absl::Now();
    result = trainer->client->Step(2).status();
    waited = absl::Now() - start;
    done.store(true);
  });
  const absl::Time post_deadline = absl::Now() + absl::Seconds(20);
  while (channel.Word(sc::kRequestSeqOffset) != 2 &&
         absl::Now() < post_deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(channel.Word(sc::kRequestSeqOffset), 2u);
  ASSERT_EQ(kill(daemon_pid_, SIGKILL), 0);
  while (!done.load()) {
    pthread_kill(step.native_handle(), SIGUSR1);
    absl::SleepFor(absl::Milliseconds(20));
  }
  step.join();
  sigaction(SIGUSR1, &previous, nullptr);
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  EXPECT_THAT(result.message(), HasSubstr("lock is gone"));
  // Far below rpc_timeout (40 s).
  EXPECT_LT(waited, absl::Seconds(20));
  EXPECT_FALSE(trainer->client->HasStepChannel());
}

// A trainer registering again on a daemon at its --max_step_channels
// replaces its channel: the daemon gives the new one the old one's slot
// (the old one's close and the new one's open come back to back, before the
// old one's thread has ended), so steps go on through a channel.
TEST_F(StepChannelTest, RegisteringAgainAtTheChannelLimitKeepsAChannel) {
  const std::string job = absl::StrCat("again", getpid());
  std::unique_ptr<Trainer> trainer =
      Register(StartDaemon(job, {"--max_step_channels=1"}), Options(job, true));
  ASSERT_NE(trainer, nullptr);
  ASSERT_TRUE(trainer->client->HasStepChannel());
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(trainer->client->Unregister().ok());
    const absl::Status registered =
        trainer->client
            ->Register({HostRegion(*trainer->region)}, {trainer->group})
            .status();
    ASSERT_TRUE(registered.ok()) << registered;
    EXPECT_TRUE(trainer->client->HasStepChannel())
        << "round " << round << ": " << trainer->client->StepChannelStatus();
  }
  ASSERT_TRUE(trainer->client->WaitForPlan(absl::Seconds(60)).ok());
  trainer->SetGrads(1);
  ASSERT_TRUE(trainer->client->Step(1).ok());
  EXPECT_EQ(ChannelRequests(job), 1);
}

}  // namespace
}  // namespace muond
