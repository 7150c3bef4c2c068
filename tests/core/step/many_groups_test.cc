// As many param groups as a registration may hold (kMaxParamGroups, one tiny
// param each, as a trainer with a group per layer registers them), stepped a
// few times under CPU load. On the host each group of a single-rank domain is
// a lane of its own: the lanes run on the engine's bounded worker pool (one
// thread per lane used to start thousands of threads, each calling OpenBLAS
// at once, and crashed host daemons). A few groups sit on two TP domains that
// both ranks share, so lanes that meet in collectives queue on the pools of
// both ranks. Also run by hand under ASan and TSan (CONTRIBUTING.md).
//
// Two ranks run as threads over Gloo (loopback) with a job communicator.
// Reference: every param's full matrix stepped alone by MuonStepFullMatrix,
// bit for bit. One more group than the cap is refused. The device-like twin
// runs every group of a rank in one lane, as on a GPU: ten rounds of grad
// check slots a step, and the single-rank groups' NS batched across them.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/step/group_count.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

constexpr int kRanks = 2;
constexpr int kGroups = int(kMaxParamGroups);
constexpr int kSteps = 3;
// Every kSharedEvery-th group is TP-split over both ranks (in one of two
// domains, alternating); the others are single-rank.
constexpr int kSharedEvery = 2500;
constexpr int64_t kRows = 2, kCols = 3;  // local shape of every param

bool Shared(int group) { return group % kSharedEvery == 0; }
int64_t FullRows(int group) { return Shared(group) ? kRows * kRanks : kRows; }
// Whose values a group's full matrix holds, and where `rank`'s rows start.
int Owner(int group, int rank) { return Shared(group) ? 0 : rank; }
int64_t Offset(int group, int rank) {
  return Shared(group) ? rank * kRows * kCols : 0;
}

// Element i of group `group`'s full matrix (owned by `rank` when not
// shared) at `step` (0: the initial param, else that step's gradient).
float Value(int group, int rank, int step, int64_t i) {
  return float((group * 31 + rank * 7 + step * 17 + i * 5) % 29) / 29.0f -
         0.45f;
}

MuonOptions TestMuon() {
  MuonOptions muon;
  muon.lr = 0.02;
  muon.momentum = 0.9;
  muon.weight_decay = 0.1;
  return muon;
}

// Keeps a core busy while the ranks step.
class CpuLoad {
 public:
  explicit CpuLoad(int threads) {
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this] {
        uint64_t x = 1;
        while (!stop_.load(std::memory_order_relaxed)) x = x * 6364136223 + 1;
        sink_.fetch_add(x, std::memory_order_relaxed);
      });
    }
  }
  ~CpuLoad() {
    stop_ = true;
    for (std::thread& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_ = false;
  std::atomic<uint64_t> sink_ = 0;
  std::vector<std::thread> threads_;
};

// The process's threads now (Linux: /proc/self/status).
int ProcessThreads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "Threads:")) return std::stoi(line.substr(8));
  }
  return -1;
}

struct RankRun {
  absl::Status status;
  // The process's threads once this rank's engine exists.
  int threads_with_engine = 0;
  // Each group's local param after the last step.
  std::vector<std::vector<float>> params;
};

std::unique_ptr<Communicator> Gloo(InMemoryKeyValueStore* store,
                                   const std::string& prefix, int rank,
                                   absl::Status& status) {
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  gloo.timeout = absl::Seconds(60);
  auto comm = CreateGlooCommunicator(store, prefix, rank, kRanks, gloo);
  if (!comm.ok()) {
    status = comm.status();
    return nullptr;
  }
  return *std::move(comm);
}

void RunRank(InMemoryKeyValueStore* store, int rank, RankRun* run) {
  std::unique_ptr<Communicator> job = Gloo(store, "job", rank, run->status);
  std::unique_ptr<Communicator> tp[2] = {Gloo(store, "a", rank, run->status),
                                         Gloo(store, "b", rank, run->status)};
  if (!run->status.ok()) return;
  std::unique_ptr<Backend> backend = testing::MakeStepTestBackend();
  run->params.assign(kGroups, std::vector<float>(kRows * kCols));
  std::vector<std::vector<float>> grads = run->params;
  std::vector<GroupConfig> configs(kGroups);
  for (int g = 0; g < kGroups; ++g) {
    GroupConfig& cfg = configs[g];
    cfg.name = absl::StrCat("layer", g);
    cfg.muon = TestMuon();
    ParamBinding b;
    b.name = absl::StrCat("w", g);
    b.full_shape = {FullRows(g), kCols};
    if (Shared(g)) {
      cfg.domain.size = DomainSize{1, kRanks};
      cfg.domain.t = rank;
      cfg.domain.tp = tp[(g / kSharedEvery) % 2].get();
      b.tags.tensor_model_parallel = true;
      b.tags.partition_dim = 0;
    }
    for (int64_t i = 0; i < kRows * kCols; ++i) {
      run->params[g][i] = Value(g, Owner(g, rank), 0, Offset(g, rank) + i);
    }
    b.param =
        ContiguousView(run->params[g].data(), DType::kFloat32, kRows, kCols);
    b.grad = ContiguousView(grads[g].data(), DType::kFloat32, kRows, kCols);
    cfg.params.push_back(b);
  }
  StepOptions options;
  options.job = job.get();
  options.lane_workers = 4;  // concurrent lanes even on a 2-core machine
  auto opt =
      LayerShardedMuon::Create(backend.get(), std::move(configs), options);
  if (!opt.ok()) {
    run->status = opt.status();
    return;
  }
  run->threads_with_engine = ProcessThreads();
  for (int g = 0; g < kGroups; ++g) {
    run->status.Update(
        (*opt)->SetHomes(absl::StrCat("layer", g), {NsHome{0, g % kRanks}}));
  }
  for (int step = 1; step <= kSteps && run->status.ok(); ++step) {
    for (int g = 0; g < kGroups; ++g) {
      for (int64_t i = 0; i < kRows * kCols; ++i) {
        grads[g][i] = Value(g, Owner(g, rank), step, Offset(g, rank) + i);
      }
    }
    run->status = (*opt)->Step({}).status();
  }
}

// Group g's full matrix after kSteps reference steps (the whole matrix of a
// shared group; rank `rank`'s own of a single-rank one).
std::vector<float> Reference(Backend& backend, NewtonSchulz& ns, int g,
                             int rank) {
  const int64_t rows = FullRows(g), n = rows * kCols;
  const int owner = Owner(g, rank);
  std::vector<float> param(n), grad(n), momentum(n, 0.0f), scratch(n);
  auto view = [&](std::vector<float>& v) {
    return ContiguousView(v.data(), DType::kFloat32, rows, kCols);
  };
  for (int64_t i = 0; i < n; ++i) param[i] = Value(g, owner, 0, i);
  for (int step = 1; step <= kSteps; ++step) {
    for (int64_t i = 0; i < n; ++i) grad[i] = Value(g, owner, step, i);
    EXPECT_TRUE(MuonStepFullMatrix(backend, TestMuon(), ns, view(param),
                                   view(grad), view(momentum), view(scratch))
                    .ok());
  }
  return param;
}

TEST(ManyGroups, TheCapOfOneParamGroupsStepsLikeTheReferenceUnderLoad) {
  InMemoryKeyValueStore store;
  RankRun runs[kRanks];
  {
    CpuLoad load(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < kRanks; ++r) {
      ranks.emplace_back(RunRank, &store, r, &runs[r]);
    }
    for (std::thread& t : ranks) t.join();
  }
  for (const RankRun& run : runs) {
    ASSERT_TRUE(run.status.ok()) << run.status;
    // The lanes run on 4 workers per engine, not a thread per lane (some
    // hundred threads of Gloo, the load and the test are plenty of margin).
    EXPECT_GT(run.threads_with_engine, 0);
    EXPECT_LT(run.threads_with_engine, 500);
  }

  std::unique_ptr<Backend> backend = MakeCpuBackend();
  auto ns_local =
      NewtonSchulz::Create(backend.get(), TestMuon().ns, kRows, kCols, 1);
  auto ns_shared = NewtonSchulz::Create(backend.get(), TestMuon().ns,
                                        kRows * kRanks, kCols, 1);
  ASSERT_TRUE(ns_local.ok() && ns_shared.ok());
  const int64_t local = kRows * kCols;
  int checked = 0;
  for (int g = 0; g < kGroups; ++g) {
    for (int r = 0; r < kRanks; ++r) {
      const std::vector<float> want =
          Reference(*backend, Shared(g) ? **ns_shared : **ns_local, g, r);
      const float* mine = want.data() + Offset(g, r);
      ASSERT_EQ(0, std::memcmp(runs[r].params[g].data(), mine, local * 4))
          << "group layer" << g << " on rank " << r;
      ++checked;
    }
  }
  EXPECT_EQ(checked, kRanks * kGroups);
}

TEST(ManyGroups, OneGroupMoreThanTheCapIsRefusedNamingCountAndCap) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<float> param(kRows * kCols), grad(kRows * kCols);
  std::vector<GroupConfig> configs(kMaxParamGroups + 1);
  for (size_t g = 0; g < configs.size(); ++g) {
    configs[g].name = absl::StrCat("layer", g);
    ParamBinding b;
    b.name = absl::StrCat("w", g);
    b.full_shape = {kRows, kCols};
    b.param = ContiguousView(param.data(), DType::kFloat32, kRows, kCols);
    b.grad = ContiguousView(grad.data(), DType::kFloat32, kRows, kCols);
    configs[g].params.push_back(b);
  }
  auto opt = LayerShardedMuon::Create(backend.get(), std::move(configs));
  ASSERT_FALSE(opt.ok());
  EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(opt.status().message(),
                                "10001 param groups exceed the cap of 10000"))
      << opt.status();
  EXPECT_TRUE(absl::StrContains(opt.status().message(), "merge the groups"))
      << opt.status();
  EXPECT_TRUE(CheckParamGroupCount(kMaxParamGroups).ok());
}

}  // namespace
}  // namespace muond
