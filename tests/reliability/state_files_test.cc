// State files: safe
// writes (unpredictable O_EXCL|O_NOFOLLOW temp files, 0600), bounded reads
// of regular files only, malformed headers as INVALID_ARGUMENT, loaded state
// validated, save/load linear in the param count, ownership, and muonctl
// save/load atomic across the job's ranks (real processes, host mode, 2x2).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <future>
#include <limits>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/operator_id.h"
#include "server/common/safetensors.h"
#include "server/common/step_id.h"
#include "server/daemon/state_file.h"
#include "tests/reliability/harness.h"

namespace muond::reliability {
namespace {

std::string TempDir() {
  char dir[] = "/tmp/muond-state-files-XXXXXX";
  EXPECT_NE(mkdtemp(dir), nullptr);
  return dir;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteRaw(const std::string& path, const std::string& header,
              const std::string& data, uint64_t length_field) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(&length_field), 8);
  f << header << data;
}

SafetensorsFile Small() {
  SafetensorsFile f;
  f.metadata["job_id"] = "j";
  f.tensors["a"] = {{2}, {1.0f, 2.0f}};
  return f;
}

// Runs `read` on a thread and waits at most `bound`: a reader that blocks
// (a FIFO opened without O_NONBLOCK) fails the test instead of hanging it.
absl::StatusOr<SafetensorsFile> ReadBounded(const std::string& path,
                                            absl::Duration bound) {
  auto promise =
      std::make_shared<std::promise<absl::StatusOr<SafetensorsFile>>>();
  auto future = promise->get_future();
  std::thread([promise, path] {
    promise->set_value(ReadSafetensors(path));
  }).detach();
  if (future.wait_for(absl::ToChronoSeconds(bound)) !=
      std::future_status::ready) {
    return absl::DeadlineExceededError("the read blocked");
  }
  return future.get();
}

// ------------------------------------------------------------- files

TEST(StateFilesTest, PlantedSymlinkAtTempPathIsNotFollowedAndFilesAre0600) {
  const std::string dir = TempDir();
  const std::string victim = dir + "/victim";
  { std::ofstream(victim) << "precious"; }
  const std::string path = dir + "/state.safetensors";
  // The temporary name the daemon used to write (<path>.tmp.<pid>).
  ASSERT_EQ(
      symlink(victim.c_str(), absl::StrCat(path, ".tmp.", getpid()).c_str()),
      0);
  ASSERT_TRUE(WriteSafetensors(path, Small()).ok());
  EXPECT_EQ(Slurp(victim), "precious");
  struct stat st;
  ASSERT_EQ(lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the planted symlink was renamed";
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // Temporary names differ per write (unpredictable; O_EXCL refuses reuse).
  auto p1 = PrepareSafetensors(path, Small());
  auto p2 = PrepareSafetensors(path, Small());
  ASSERT_TRUE(p1.ok() && p2.ok());
  EXPECT_NE(p1->temp_path, p2->temp_path);
  ASSERT_EQ(stat(p1->temp_path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  AbortSafetensors(*p1);
  AbortSafetensors(*p2);
  EXPECT_NE(access(p1->temp_path.c_str(), F_OK), 0);
  // A failed save names the path and the errno text.
  absl::Status failed =
      WriteSafetensors(dir + "/missing/state.safetensors", Small()).status();
  EXPECT_FALSE(failed.ok());
  EXPECT_TRUE(absl::StrContains(failed.message(), "/missing/state")) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), strerror(ENOENT))) << failed;
  std::string out;
  RunTool({"/bin/rm", "-rf", dir}, &out);
}

TEST(StateFilesTest, NonRegularFilesAreRefusedPromptly) {
  const std::string dir = TempDir();
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, std::string("/dev/zero"), dir}) {
    absl::StatusOr<SafetensorsFile> r = ReadBounded(path, absl::Seconds(10));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << path << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "not a regular file"))
        << r.status();
  }
  std::string out;
  RunTool({"/bin/rm", "-rf", dir}, &out);
}

TEST(StateFilesTest, MalformedHeadersAreInvalidArgumentNamingTheField) {
  const std::string dir = TempDir();
  const std::string path = dir + "/bad.safetensors";
  const std::string data(8, '\0');  // two floats
  struct Case {
    std::string header;
    std::string field;  // expected in the message
  };
  const std::vector<Case> cases = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":["x",8]}})",
       "data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})",
       "data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,800]}})",
       "data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}})",
       "data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})",
       "data_offsets"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       "overlaps"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "gap"},
      {R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "shape"},
      {R"({"a":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}})", "shape"},
      {R"({"a":{"shape":[2],"data_offsets":[0,8]}})", "dtype"},
      {R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", "dtype"},
      {R"({"a":[1,2]})", "not a JSON object"},
      {R"([1,2])", "not a JSON object"},
      {R"({"__metadata__":{"k":1}})", "__metadata__"},
      {R"({"a":)", "not valid JSON"},
  };
  for (const Case& c : cases) {
    WriteRaw(path, c.header, data, c.header.size());
    absl::StatusOr<SafetensorsFile> r = ReadSafetensors(path);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << c.header << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), c.field))
        << c.header << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), path)) << r.status();
  }
  // Header lengths: beyond the limit, beyond the file.
  for (uint64_t n : {uint64_t{1} << 40, uint64_t{1000}}) {
    WriteRaw(path, "{}", "", n);
    absl::StatusOr<SafetensorsFile> r = ReadSafetensors(path);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << n << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "header length"))
        << r.status();
  }
  std::string out;
  RunTool({"/bin/rm", "-rf", dir}, &out);
}

// ------------------------------------------------------- state contents

// One Muon group "g" at (0, 0) with `n` params p<i> of local shape [4] (their
// memory is not needed to map or check state).
std::unique_ptr<Registration> ManyParams(int n) {
  auto reg = std::make_unique<Registration>();
  reg->client_id = "trainer";
  BoundGroup g;
  g.proto.set_name("g");
  g.proto.mutable_domain()->set_gtp_size(1);
  g.proto.mutable_domain()->set_tp_size(1);
  for (int i = 0; i < n; ++i) {
    BoundParam p;
    p.name = absl::StrCat("layer.", i, ".w");  // dots, as torch names
    p.local_shape = {4};
    g.params.push_back(std::move(p));
  }
  reg->groups.push_back(std::move(g));
  reg->num_params = n;
  return reg;
}

constexpr int64_t kMaxStep = kMaxStepId;

StateTensors ManyState(int n) {
  StateTensors state;
  for (int i = 0; i < n; ++i) {
    state[absl::StrCat("g/layer.", i, ".w.momentum")] = {float(i), 1, 2, 3};
  }
  return state;
}

TEST(StateFilesTest, HundredThousandParamsSaveAndLoadInSeconds) {
  constexpr int kParams = 100000;
  const std::string dir = TempDir();
  const std::string path = dir + "/many.safetensors";
  auto reg = ManyParams(kParams);
  const StateTensors state = ManyState(kParams);
  const absl::Time t0 = absl::Now();
  SafetensorsFile file = StateToFile(*reg, state, {"job", 0, 41, 1});
  ASSERT_TRUE(WriteSafetensors(path, file).ok());
  const absl::Time t1 = absl::Now();
  absl::StatusOr<SafetensorsFile> read = ReadSafetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_TRUE(read->tensors.count("g/layer.7.w/g0t0/momentum"));
  absl::StatusOr<LoadedState> loaded =
      StateFromFile(path, *std::move(read), *reg, state, "job", kMaxStep);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const absl::Time t2 = absl::Now();
  EXPECT_EQ(loaded->step_id, 41);
  EXPECT_EQ(loaded->state, state);
  // No timed assertion (a loaded CI machine); the figure goes to the log.
  std::cout << kParams << " params: save " << (t1 - t0) << ", load "
            << (t2 - t1) << "\n";
  std::string out;
  RunTool({"/bin/rm", "-rf", dir}, &out);
}

TEST(StateFilesTest, LoadedValuesAreChecked) {
  auto reg = ManyParams(2);
  StateTensors current = ManyState(2);
  current["g/.step"] = {3};
  current["g/layer.0.w.exp_avg_sq"] = {0, 0, 0, 0};
  SafetensorsFile good = StateToFile(*reg, current, {"job", 0, 5, 1});
  ASSERT_TRUE(StateFromFile("f", good, *reg, current, "job", kMaxStep).ok());
  struct Case {
    std::string key;
    int index;
    float value;
    std::string expect;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const Case& c :
       std::vector<Case>{{"g/layer.1.w/g0t0/momentum", 2, nan, "index 2"},
                         {"g/layer.0.w/g0t0/momentum", 3, -inf, "index 3"},
                         {"g/layer.0.w/g0t0/exp_avg_sq", 1, -1.0f, "negative"},
                         {"g/.step", 0, 2.5f, "step count"},
                         {"g/.step", 0, -1.0f, "step count"},
                         {"g/.step", 0, 1e30f, "step count"}}) {
    SafetensorsFile bad = good;
    bad.tensors[c.key].data[c.index] = c.value;
    absl::Status st =
        StateFromFile("f", bad, *reg, current, "job", kMaxStep).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_TRUE(absl::StrContains(st.message(), c.key)) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), c.expect)) << st;
  }
  for (const std::string step : {"-2", "4611686018427387905", "x", ""}) {
    SafetensorsFile bad = good;
    bad.metadata["step_id"] = step;
    absl::Status st =
        StateFromFile("f", bad, *reg, current, "job", kMaxStep).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << step;
    EXPECT_TRUE(absl::StrContains(st.message(), "step_id")) << st;
  }
  SafetensorsFile extra = good;
  extra.tensors["g/other/g0t0/momentum"] = {{1}, {0}};
  EXPECT_TRUE(absl::StrContains(
      StateFromFile("f", extra, *reg, current, "job", kMaxStep)
          .status()
          .message(),
      "no registered param"));
}

// AdamW step counts are per param ("<group>/<param>.step", torch.optim's
// state[p]["step"]); a file written with one count per group ("<group>/.step")
// still loads, every param of the group getting that count.
TEST(StateFilesTest, AdamWStepCountsPerParamAndOldGroupCountLoads) {
  auto reg = ManyParams(2);
  reg->groups[0].proto.set_algorithm(v1::ALGORITHM_ADAMW);
  StateTensors current;
  for (int i = 0; i < 2; ++i) {
    const std::string p = absl::StrCat("g/layer.", i, ".w");
    current[p + ".exp_avg"] = {1, 2, 3, float(i)};
    current[p + ".exp_avg_sq"] = {1, 2, 3, 4};
    current[p + ".step"] = {float(3 + i)};
  }
  SafetensorsFile file = StateToFile(*reg, current, {"job", 0, 5, 1});
  ASSERT_TRUE(file.tensors.count("g/layer.1.w/g0t0/step"));
  absl::StatusOr<LoadedState> loaded =
      StateFromFile("f", file, *reg, current, "job", kMaxStep);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->state, current);

  SafetensorsFile old = file;
  old.tensors.erase("g/layer.0.w/g0t0/step");
  old.tensors.erase("g/layer.1.w/g0t0/step");
  old.tensors["g/.step"] = {{1}, {7}};
  loaded = StateFromFile("f", old, *reg, current, "job", kMaxStep);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->state.at("g/layer.0.w.step"), std::vector<float>{7});
  EXPECT_EQ(loaded->state.at("g/layer.1.w.step"), std::vector<float>{7});
  old.tensors["g/.step"] = {{1}, {2.5f}};
  const absl::Status bad =
      StateFromFile("f", old, *reg, current, "job", kMaxStep).status();
  EXPECT_TRUE(absl::StrContains(bad.message(), "step count")) << bad;
  // A per-param count is checked as the group's was.
  SafetensorsFile negative = file;
  negative.tensors["g/layer.1.w/g0t0/step"].data[0] = -1;
  EXPECT_TRUE(absl::StrContains(
      StateFromFile("f", negative, *reg, current, "job", kMaxStep)
          .status()
          .message(),
      "step count"));
}

// ------------------------------------------------------ through the daemons

std::string Muonctl(const Cluster& c, const std::string& sub,
                    const std::string& dir, int* rc) {
  std::string out;
  *rc = RunTool(
      {Runfile("tools/muonctl/muonctl"), sub,
       "--coordinator=" + c.coordinator(), "--job=" + c.job(), "--dir=" + dir},
      &out);
  return out;
}

std::vector<int> Steps(int first, int last) {
  std::vector<int> v;
  for (int s = first; s <= last; ++s) v.push_back(s);
  return v;
}

void ExpectBitwise(const std::vector<float>& got,
                   const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(memcmp(got.data(), want.data(), got.size() * 4), 0) << what;
}

class StateOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<Cluster>(Cluster::Options{});
    cluster_->StartAll();
    trainers_ = std::make_unique<Trainers>(*cluster_, "s");
    ASSERT_TRUE(trainers_->RegisterAll().ok());
    ASSERT_TRUE(trainers_->RunSteps(1, 3).ok());
    state_ = cluster_->dir() + "/state";
    ASSERT_EQ(mkdir(state_.c_str(), 0700), 0);
    int rc = 0;
    const std::string out = Muonctl(*cluster_, "save", state_, &rc);
    ASSERT_EQ(rc, 0) << out;
    ASSERT_TRUE(absl::StrContains(out, "saved 4 ranks at step 3")) << out;
  }

  std::unique_ptr<v1::Optimizer::Stub> Stub(int rank) {
    return v1::Optimizer::NewStub(
        grpc::CreateChannel("unix://" + cluster_->socket(rank),
                            grpc::InsecureChannelCredentials()));
  }

  // LoadState on rank 0 as its owner (job "s" trainers' client id) or as
  // `client`, with a 10 s deadline.
  grpc::Status Load(const std::string& path, const std::string& client) {
    v1::LoadStateRequest req;
    req.set_path(path);
    req.set_job_id(cluster_->job());
    req.set_client_id(client);
    v1::LoadStateResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    return Stub(0)->LoadState(&ctx, req, &resp);
  }
  // A phased LoadState of rank `r`'s file as the operator.
  grpc::Status PhasedLoad(int r, v1::StatePhase phase, const std::string& id,
                          int64_t* step_id = nullptr) {
    v1::LoadStateRequest req;
    req.set_path(RankFile(r));
    req.set_job_id(cluster_->job());
    req.set_client_id(OperatorClientId(""));  // the tokenless cluster's
    req.set_phase(phase);
    req.set_transaction_id(id);
    v1::LoadStateResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(10));
    grpc::Status st = Stub(r)->LoadState(&ctx, req, &resp);
    if (step_id != nullptr) *step_id = resp.step_id();
    return st;
  }
  std::string Owner() { return trainers_->client(0).options().client_id; }

  void ExpectAllAtStep(int64_t step) {
    for (int r = 0; r < kWorld; ++r) {
      auto s = trainers_->client(r).Status();
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->last_step_id(), step) << "rank " << r;
    }
  }

  std::string RankFile(int r) const {
    return absl::StrCat(state_, "/rank", r, ".safetensors");
  }

  std::unique_ptr<Cluster> cluster_;
  std::unique_ptr<Trainers> trainers_;
  std::string state_;
};

TEST_F(StateOpsTest, OnlyTheOwnerOrTheOperatorSavesAndLoads) {
  for (const std::string client : {"intruder", ""}) {
    grpc::Status st = Load(RankFile(0), client);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << client << ": " << st.error_message();
    v1::SaveStateRequest save;
    save.set_path(state_ + "/intruder.safetensors");
    save.set_job_id(cluster_->job());
    save.set_client_id(client);
    v1::SaveStateResponse resp;
    grpc::ClientContext ctx;
    EXPECT_EQ(Stub(0)->SaveState(&ctx, save, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_NE(access((state_ + "/intruder.safetensors").c_str(), F_OK), 0);
  EXPECT_TRUE(Load(RankFile(0), Owner()).ok());
}

TEST_F(StateOpsTest, BadFilesAreRefusedAndTheDaemonStaysResponsive) {
  const std::string fifo = state_ + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::string offsets = state_ + "/offsets.safetensors";
  const std::string header =
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":["x",4]}})";
  WriteRaw(offsets, header, std::string(4, '\0'), header.size());
  // NaN momentum: the next step would make every param NaN.
  absl::StatusOr<SafetensorsFile> nan_file = ReadSafetensors(RankFile(0));
  ASSERT_TRUE(nan_file.ok()) << nan_file.status();
  std::string nan_key;
  for (auto& [key, t] : nan_file->tensors) {
    if (absl::EndsWith(key, "/momentum") && t.data.size() > 1) {
      t.data[1] = std::numeric_limits<float>::quiet_NaN();
      nan_key = key;
      break;
    }
  }
  ASSERT_FALSE(nan_key.empty());
  const std::string nan_path = state_ + "/nan.safetensors";
  ASSERT_TRUE(WriteSafetensors(nan_path, *nan_file).ok());
  const std::vector<std::pair<std::string, std::string>> cases = {
      {fifo, "not a regular file"},
      {"/dev/zero", "not a regular file"},
      {offsets, "data_offsets"},
      {nan_path, nan_key + "' has the non-finite value nan at index 1"}};
  for (const auto& [path, expect] : cases) {
    const absl::Time start = absl::Now();
    grpc::Status st = Load(path, Owner());
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << path << ": " << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), expect))
        << st.error_message();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << path;
    auto health = trainers_->client(0).Health();
    ASSERT_TRUE(health.ok()) << health.status();
  }
  ExpectAllAtStep(3);
  // Nothing was loaded: the next steps match the uninterrupted reference.
  ASSERT_TRUE(trainers_->RunSteps(4, 4).ok());
  ExpectBitwise(trainers_->Shards(), trainers_->ReferenceShards(Steps(1, 4)),
                "after the refused loads");
}

TEST_F(StateOpsTest, MuonctlLoadIsAllOrNothingAcrossRanks) {
  ASSERT_TRUE(trainers_->RunSteps(4, 5).ok());
  const std::string good2 = Slurp(RankFile(2));
  // Rank 2's file has a NaN; rank 1's is missing in the second round.
  absl::StatusOr<SafetensorsFile> f = ReadSafetensors(RankFile(2));
  ASSERT_TRUE(f.ok());
  for (auto& [key, t] : f->tensors) t.data[0] = std::nanf("");
  ASSERT_TRUE(WriteSafetensors(RankFile(2), *f).ok());
  int rc = 0;
  std::string out = Muonctl(*cluster_, "load", state_, &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "rank 2")) << out;
  EXPECT_TRUE(absl::StrContains(out, "non-finite")) << out;
  EXPECT_TRUE(absl::StrContains(out, "no rank's state changed")) << out;
  ExpectAllAtStep(5);

  { std::ofstream(RankFile(2), std::ios::binary | std::ios::trunc) << good2; }
  ASSERT_EQ(rename(RankFile(1).c_str(), (state_ + "/moved").c_str()), 0);
  out = Muonctl(*cluster_, "load", state_, &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "rank 1")) << out;
  ExpectAllAtStep(5);
  // No rank's momentum changed either: step 6 continues the run bitwise.
  ASSERT_TRUE(trainers_->RunSteps(6, 6).ok());
  ExpectBitwise(trainers_->Shards(), trainers_->ReferenceShards(Steps(1, 6)),
                "after the refused muonctl loads");

  // With every file good the load completes on every rank.
  ASSERT_EQ(rename((state_ + "/moved").c_str(), RankFile(1).c_str()), 0);
  out = Muonctl(*cluster_, "load", state_, &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "next step id is 4")) << out;
  ExpectAllAtStep(3);
}

TEST_F(StateOpsTest, MuonctlSaveIsAllOrNothingAcrossRanks) {
  ASSERT_TRUE(trainers_->RunSteps(4, 4).ok());
  const std::string before = Slurp(RankFile(0));
  // Rank 3 cannot write its file (a directory is in the way).
  ASSERT_EQ(unlink(RankFile(3).c_str()), 0);
  ASSERT_EQ(mkdir(RankFile(3).c_str(), 0700), 0);
  int rc = 0;
  const std::string out = Muonctl(*cluster_, "save", state_, &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "rank 3")) << out;
  // Rank 0's file is still the step-3 one, and no temporary file is left.
  EXPECT_EQ(Slurp(RankFile(0)), before);
  std::string ls;
  RunTool({"/bin/ls", state_}, &ls);
  EXPECT_FALSE(absl::StrContains(ls, ".tmp.")) << ls;
}

// Overlapping save/load transactions: a second transaction's PREPARE used to
// replace a pending one, so the first one's COMMIT failed on that rank only
// (half the job loaded, step ids split). Now it is refused and the first one
// commits everywhere; a second muonctl fails without disturbing it.
TEST_F(StateOpsTest, ConcurrentLoadTransactionCannotSplitTheJob) {
  ASSERT_TRUE(trainers_->RunSteps(4, 5).ok());
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(PhasedLoad(r, v1::STATE_PHASE_PREPARE, "A").ok()) << r;
  }
  grpc::Status b = PhasedLoad(0, v1::STATE_PHASE_PREPARE, "B");
  EXPECT_EQ(b.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << b.error_message();
  EXPECT_TRUE(absl::StrContains(b.error_message(), "'A'")) << b.error_message();
  EXPECT_TRUE(PhasedLoad(0, v1::STATE_PHASE_ABORT, "B").ok());
  // A whole second muonctl: every PREPARE refused, it aborts only its own.
  int rc = 0;
  const std::string out = Muonctl(*cluster_, "load", state_, &rc);
  EXPECT_NE(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "'A'")) << out;
  EXPECT_TRUE(absl::StrContains(out, "no rank's state changed")) << out;
  ExpectAllAtStep(5);
  for (int r = 0; r < kWorld; ++r) {
    int64_t step = -1;
    grpc::Status st = PhasedLoad(r, v1::STATE_PHASE_COMMIT, "A", &step);
    ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st.error_message();
    EXPECT_EQ(step, 3) << "rank " << r;
  }
  ExpectAllAtStep(3);
  ASSERT_TRUE(trainers_->RunSteps(4, 4).ok());
  ExpectAllAtStep(4);
}

}  // namespace
}  // namespace muond::reliability
