// The chaos test: a 2x2 host-mode job (4 daemons, 1
// coordinator, real binaries) stepped by this process as the 4 trainers for
// a few hundred steps, with seeded random events in between:
//
//   nan_dense   a NaN gradient in the 2x2 Muon group on one random rank
//   nan_solo    a NaN gradient in one rank's own AdamW group (1x1 domain)
//   bad_lr      an override lr=-1 sent to one random rank only
//   save / load muonctl save|load of the job's checkpoint
//   kill        SIGKILL of a random daemon before or while a step runs,
//               then restart
//   stop        SIGSTOP of a random daemon before or while a step runs, for
//               longer than the comm timeout, then SIGCONT
//   coordinator SIGKILL of the coordinator, steps, restart on its port
//
// A refusal (nan_*, bad_lr) must be answered by every rank and change
// nothing. A step that fails under kill or stop must leave every rank whose
// step failed untouched (all-or-nothing), then the trainers recover as a
// real one does: re-register every rank, muonctl load of the last
// checkpoint, restore their own params to it. At the end (and after every
// event) every rank's params equal an in-process reference that replays exactly
// the steps reported applied, with saves/loads as snapshot/restore: bitwise
// (Muon on full matrices with ns_batch_size 1 and AdamW are bitwise to the
// daemons in host mode, as in reliability_test.cc).
//
// The seed is logged; CHAOS_SEED=<n> replays one, CHAOS_STEPS=<n> changes
// the length, CHAOS_EVENTS=a,b,... picks the events (default: all).
// A default run takes ~45 s on 2 cores.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/backend/cpu_backend.h"
#include "core/muon/adamw.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "server/daemon/engine_factory.h"
#include "tests/reliability/harness.h"

namespace muond::reliability {
namespace {

// Every event runs by default (CHAOS_EVENTS picks a subset).
constexpr const char* kDefaultEvents =
    "nan_dense,nan_solo,bad_lr,save,load,kill,stop,coordinator";
constexpr int kSoloSize = 48;
constexpr int kCommTimeoutS = 2;

int EnvInt(const char* name, int fallback) {
  const char* v = getenv(name);
  return v != nullptr && *v != '\0' ? atoi(v) : fallback;
}

// The AdamW group each rank holds alone, as muond.torch places it.
v1::ParamGroup SoloGroup(int rank) {
  v1::ParamGroup group;
  group.set_name(absl::StrCat("adamw.solo-r", rank));
  group.set_algorithm(v1::ALGORITHM_ADAMW);
  group.mutable_adamw()->set_lr(0.01);
  group.mutable_adamw()->set_weight_decay(0.01);
  v1::Domain* d = group.mutable_domain();
  d->set_name(absl::StrCat("solo-r", rank));
  d->set_gtp_size(1);
  d->set_tp_size(1);
  return group;
}

std::string SoloName(int rank) { return absl::StrCat("bias", rank); }

// ------------------------------------------------------------ reference

// Full matrices of the dense group and every rank's solo param, stepped in
// process; copyable, so a checkpoint is a copy.
struct Reference {
  struct Dense {
    std::vector<float> p, m;
  };
  struct Solo {
    std::vector<float> p, m, v;
  };
  std::vector<Dense> dense;  // [weight]
  std::vector<Solo> solo;    // [rank]
  int64_t applied = 0;       // last applied step id (AdamW's step number)

  static Reference Initial() {
    Reference r;
    for (const Weight& w : Weights()) {
      Dense d{std::vector<float>(w.rows * w.cols), {}};
      for (int64_t i = 0; i < w.rows; ++i)
        for (int64_t j = 0; j < w.cols; ++j)
          d.p[i * w.cols + j] = Value(w.name, 0, i, j);
      d.m.assign(d.p.size(), 0.0f);
      r.dense.push_back(std::move(d));
    }
    for (int rank = 0; rank < kWorld; ++rank) {
      Solo s{std::vector<float>(kSoloSize), {}, {}};
      for (int j = 0; j < kSoloSize; ++j)
        s.p[j] = Value(SoloName(rank), 0, 0, j);
      s.m.assign(kSoloSize, 0.0f);
      s.v.assign(kSoloSize, 0.0f);
      r.solo.push_back(std::move(s));
    }
    return r;
  }

  // Applies the gradients of step `id` (= applied + 1).
  void Apply(int64_t id) {
    static std::unique_ptr<Backend> backend = MakeCpuBackend();
    const MuonOptions muon = *MuonOptionsFromProto(BaseGroup(0, 0));
    for (size_t k = 0; k < Weights().size(); ++k) {
      const Weight& w = Weights()[k];
      Dense& d = dense[k];
      std::vector<float> g(d.p.size()), scratch(d.p.size());
      for (int64_t i = 0; i < w.rows; ++i)
        for (int64_t j = 0; j < w.cols; ++j)
          g[i * w.cols + j] = Value(w.name + "/grad", int(id), i, j);
      auto view = [&](std::vector<float>& v) {
        return ContiguousView(v.data(), DType::kFloat32, w.rows, w.cols);
      };
      auto ns = NewtonSchulz::Create(backend.get(), muon.ns, w.rows, w.cols, 1);
      (void)MuonStepFullMatrix(*backend, muon, **ns, view(d.p), view(g),
                               view(d.m), view(scratch));
    }
    for (int rank = 0; rank < kWorld; ++rank) {
      const AdamWOptions adamw = *AdamWOptionsFromProto(SoloGroup(rank));
      Solo& s = solo[rank];
      std::vector<float> g(kSoloSize);
      for (int j = 0; j < kSoloSize; ++j)
        g[j] = Value(SoloName(rank) + "/grad", int(id), 0, j);
      auto view = [](std::vector<float>& v) {
        return ContiguousView(v.data(), DType::kFloat32, 1, kSoloSize);
      };
      (void)AdamWStep(*backend, adamw, id, view(s.p), view(g), view(s.m),
                      view(s.v));
    }
    applied = id;
  }

  // Rank `rank`'s view: its shard of every dense weight, then its solo param.
  std::vector<float> RankParams(int rank) const {
    std::vector<float> out;
    const int g = rank / kT, t = rank % kT;
    for (size_t k = 0; k < Weights().size(); ++k) {
      const Weight& w = Weights()[k];
      const testing::Shard sh = testing::ShardOf(w, kG, kT, g, t);
      for (int64_t i = 0; i < sh.real; ++i)
        for (int64_t j = 0; j < sh.nc; ++j)
          out.push_back(dense[k].p[(sh.r0 + i) * w.cols + sh.c0 + j]);
    }
    out.insert(out.end(), solo[rank].p.begin(), solo[rank].p.end());
    return out;
  }
};

// ------------------------------------------------------------ trainers

// One rank's trainer: a shm region with its padded local shard of every
// dense weight and its solo param, with their gradients.
struct RankTrainer {
  std::unique_ptr<ShmRegion> region;
  std::vector<float*> param, grad;  // [weight] local shards, then solo
  std::vector<int64_t> size;        // elements of each
  v1::ParamGroup dense, solo;
  std::unique_ptr<Client> client;
};

class ChaosTrainers {
 public:
  explicit ChaosTrainers(const Cluster& cluster) : cluster_(cluster) {
    for (int rank = 0; rank < kWorld; ++rank) ranks_.push_back(MakeRank(rank));
  }

  // Unregisters what is registered (ignoring errors: a restarted daemon has
  // nothing), then registers every rank and waits for the plans.
  absl::Status RegisterAll() {
    for (RankTrainer& t : ranks_) {
      if (t.client != nullptr) (void)t.client->Unregister();
      t.client.reset();
    }
    for (int r = 0; r < kWorld; ++r) {
      auto client = cluster_.ConnectTrainer(r);
      if (!client.ok()) return client.status();
      ranks_[r].client = *std::move(client);
    }
    std::vector<absl::Status> st(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        RankTrainer& t = ranks_[r];
        auto reg =
            t.client->Register({HostRegion(*t.region)}, {t.dense, t.solo});
        st[r] =
            // Generous: on a loaded 2-core CI machine four engines' Gloo
            // rendezvous took over 30 s once (a bound, not a timing).
            reg.ok() ? t.client->WaitForPlan(absl::Seconds(90)) : reg.status();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kWorld; ++r) {
      if (!st[r].ok())
        return absl::Status(st[r].code(),
                            absl::StrCat("rank ", r, ": ", st[r].message(),
                                         cluster_.ServerLogs(25)));
    }
    return absl::OkStatus();
  }

  // Gradients of step `id`; `poison_rank` >= 0 puts a NaN into that rank's
  // shard of the dense weight `poison` ("" = its solo param).
  void FillGrads(int64_t id, int poison_rank = -1,
                 const std::string& poison = "") {
    for (int rank = 0; rank < kWorld; ++rank) {
      RankTrainer& t = ranks_[rank];
      const int g = rank / kT, tt = rank % kT;
      for (size_t k = 0; k < Weights().size(); ++k) {
        const Weight& w = Weights()[k];
        const testing::Shard sh = testing::ShardOf(w, kG, kT, g, tt);
        memset(t.grad[k], 0, 4 * t.size[k]);
        for (int64_t i = 0; i < sh.real; ++i)
          for (int64_t j = 0; j < sh.nc; ++j)
            t.grad[k][i * sh.nc + j] =
                Value(w.name + "/grad", int(id), sh.r0 + i, sh.c0 + j);
        if (rank == poison_rank && w.name == poison)
          t.grad[k][0] = std::numeric_limits<float>::quiet_NaN();
      }
      float* solo = t.grad.back();
      for (int j = 0; j < kSoloSize; ++j)
        solo[j] = Value(SoloName(rank) + "/grad", int(id), 0, j);
      if (rank == poison_rank && poison.empty())
        solo[1] = std::numeric_limits<float>::quiet_NaN();
    }
  }

  // Step `id` on every rank concurrently; `bad_lr_rank` gets lr=-1.
  std::vector<absl::StatusOr<v1::StepResponse>> StepAll(int64_t id,
                                                        int bad_lr_rank = -1) {
    std::vector<absl::StatusOr<v1::StepResponse>> out(
        kWorld, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        std::vector<v1::GroupOverride> overrides;
        if (r == bad_lr_rank) {
          v1::GroupOverride o;
          o.set_group(ranks_[r].dense.name());
          o.set_lr(-1.0);
          overrides.push_back(o);
        }
        out[r] = ranks_[r].client->Step(id, overrides);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  std::vector<float> RankParams(int rank) const {
    const RankTrainer& t = ranks_[rank];
    const int g = rank / kT, tt = rank % kT;
    std::vector<float> out;
    for (size_t k = 0; k < Weights().size(); ++k) {
      const testing::Shard sh = testing::ShardOf(Weights()[k], kG, kT, g, tt);
      out.insert(out.end(), t.param[k], t.param[k] + sh.real * sh.nc);
    }
    out.insert(out.end(), t.param.back(), t.param.back() + kSoloSize);
    return out;
  }

  // Every param buffer of every rank (a trainer's model checkpoint).
  std::vector<std::vector<float>> SaveParams() const {
    std::vector<std::vector<float>> out;
    for (const RankTrainer& t : ranks_)
      for (size_t k = 0; k < t.param.size(); ++k)
        out.emplace_back(t.param[k], t.param[k] + t.size[k]);
    return out;
  }
  void RestoreParams(const std::vector<std::vector<float>>& saved) {
    size_t n = 0;
    for (RankTrainer& t : ranks_)
      for (size_t k = 0; k < t.param.size(); ++k)
        memcpy(t.param[k], saved[n++].data(), 4 * t.size[k]);
  }

 private:
  RankTrainer MakeRank(int rank) {
    static int counter = 0;
    RankTrainer t;
    const int g = rank / kT, tt = rank % kT;
    size_t bytes = 4 * 4 * kSoloSize + 8192;
    for (const Weight& w : Weights())
      bytes += 4 * 2 * (w.rows + 8) * w.cols + 4096;
    t.region = *ShmRegion::Create(
        absl::StrCat("/muond-chaos-", getpid(), "-", counter++, "-r", rank),
        bytes);
    t.dense = BaseGroup(g, tt);
    t.solo = SoloGroup(rank);
    for (const Weight& w : Weights()) {
      const testing::Shard sh = testing::ShardOf(w, kG, kT, g, tt);
      const int64_t n = sh.nr * sh.nc;
      float* p = static_cast<float*>(*t.region->Allocate(4 * n));
      float* gr = static_cast<float*>(*t.region->Allocate(4 * n));
      memset(p, 0, 4 * n);
      memset(gr, 0, 4 * n);
      for (int64_t i = 0; i < sh.real; ++i)
        for (int64_t j = 0; j < sh.nc; ++j)
          p[i * sh.nc + j] = Value(w.name, 0, sh.r0 + i, sh.c0 + j);
      v1::ShardTags tags;
      tags.set_tensor_model_parallel(w.tp_dim >= 0);
      tags.set_partition_dim(w.tp_dim >= 0 ? w.tp_dim : 0);
      tags.set_is_gtp_weight_remat(w.gtp);
      tags.set_pad_length(w.pad);
      *t.dense.add_params() = MakeParam(
          w.name, {w.rows, w.cols},
          *HostRef(*t.region, p, v1::DTYPE_FP32, {sh.nr, sh.nc}),
          *HostRef(*t.region, gr, v1::DTYPE_FP32, {sh.nr, sh.nc}), tags);
      t.param.push_back(p);
      t.grad.push_back(gr);
      t.size.push_back(n);
    }
    float* p = static_cast<float*>(*t.region->Allocate(4 * kSoloSize));
    float* gr = static_cast<float*>(*t.region->Allocate(4 * kSoloSize));
    for (int j = 0; j < kSoloSize; ++j) p[j] = Value(SoloName(rank), 0, 0, j);
    *t.solo.add_params() =
        MakeParam(SoloName(rank), {kSoloSize},
                  *HostRef(*t.region, p, v1::DTYPE_FP32, {kSoloSize}),
                  *HostRef(*t.region, gr, v1::DTYPE_FP32, {kSoloSize}));
    t.param.push_back(p);
    t.grad.push_back(gr);
    t.size.push_back(kSoloSize);
    return t;
  }

  const Cluster& cluster_;
  std::vector<RankTrainer> ranks_;
};

// ------------------------------------------------------------ the run

std::string Describe(const std::vector<absl::StatusOr<v1::StepResponse>>& rs) {
  std::string out;
  for (int r = 0; r < kWorld; ++r)
    absl::StrAppend(&out, "\n  rank ", r, ": ",
                    rs[r].ok() ? "OK" : rs[r].status().ToString());
  return out;
}

class Chaos {
 public:
  Chaos(uint32_t seed, std::set<std::string> events)
      : rng_(seed),
        events_(std::move(events)),
        cluster_({.daemon_flags = {
                      absl::StrCat("--comm_timeout_s=", kCommTimeoutS)}}) {}

  void Run(int steps) {
    cluster_.StartAll();
    trainers_ = std::make_unique<ChaosTrainers>(cluster_);
    ASSERT_TRUE(trainers_->RegisterAll().ok());
    ckpt_dir_ = cluster_.dir() + "/ckpt";
    ASSERT_EQ(mkdir(ckpt_dir_.c_str(), 0700), 0);
    ASSERT_NO_FATAL_FAILURE(CleanStep());
    ASSERT_NO_FATAL_FAILURE(Save());
    std::vector<std::string> menu(events_.begin(), events_.end());
    while (ref_.applied < steps && !::testing::Test::HasFatalFailure()) {
      const bool event = !menu.empty() && Uniform(0, 9) == 0;
      if (!event) {
        ASSERT_NO_FATAL_FAILURE(CleanStep());
        continue;
      }
      const std::string e = menu[Uniform(0, int(menu.size()) - 1)];
      if (!Budget(e)) continue;
      Log(e);
      ASSERT_NO_FATAL_FAILURE(Event(e));
      ASSERT_NO_FATAL_FAILURE(ExpectMatchesReference(e));
    }
    ASSERT_NO_FATAL_FAILURE(ExpectMatchesReference("the end"));
    for (const auto& [e, n] : counts_) Log(absl::StrCat(e, " x", n));
  }

 private:
  int Uniform(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  void Log(const std::string& what) {
    fprintf(stderr, "[chaos] after step %ld: %s\n", long(ref_.applied),
            what.c_str());
  }
  // Slow events are bounded so the test stays well under its time limit.
  bool Budget(const std::string& e) {
    static const std::map<std::string, int> kMax = {
        {"kill", 3}, {"stop", 2}, {"coordinator", 2}};
    auto it = kMax.find(e);
    if (it != kMax.end() && counts_[e] >= it->second) return false;
    ++counts_[e];
    return true;
  }

  void Event(const std::string& e) {
    if (e == "nan_dense") {
      const int rank = Uniform(0, kWorld - 1);
      const std::string w =
          Weights()[Uniform(0, int(Weights().size()) - 1)].name;
      trainers_->FillGrads(next(), rank, w);
      ExpectRefusedEverywhere(trainers_->StepAll(next()),
                              absl::StrCat("NaN in ", w, " on rank ", rank));
    } else if (e == "nan_solo") {
      const int rank = Uniform(0, kWorld - 1);
      trainers_->FillGrads(next(), rank, "");
      ExpectRefusedEverywhere(trainers_->StepAll(next()),
                              absl::StrCat("NaN in ", SoloName(rank)));
    } else if (e == "bad_lr") {
      const int rank = Uniform(0, kWorld - 1);
      trainers_->FillGrads(next());
      ExpectRefusedEverywhere(trainers_->StepAll(next(), rank),
                              absl::StrCat("lr=-1 on rank ", rank));
    } else if (e == "save") {
      Save();
    } else if (e == "load") {
      Load();
    } else if (e == "coordinator") {
      cluster_.KillCoordinator();
      for (int i = 0; i < 3; ++i) ASSERT_NO_FATAL_FAILURE(CleanStep());
      cluster_.StartCoordinator();
      ASSERT_TRUE(cluster_.WaitDaemonsLive(true, absl::Seconds(30)))
          << "daemons did not re-join the restarted coordinator";
    } else if (e == "kill" || e == "stop") {
      ProcessFault(e == "kill");
    }
  }

  int64_t next() const { return ref_.applied + 1; }

  // Steps `next()` with clean gradients; every rank must apply it.
  void CleanStep() {
    trainers_->FillGrads(next());
    auto rs = trainers_->StepAll(next());
    for (int r = 0; r < kWorld; ++r)
      ASSERT_TRUE(rs[r].ok()) << "clean step " << next() << Describe(rs);
    ref_.Apply(next());
  }

  void ExpectRefusedEverywhere(
      const std::vector<absl::StatusOr<v1::StepResponse>>& rs,
      const std::string& what) {
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_FALSE(rs[r].ok())
          << what << ": step " << next() << " must be refused on every rank"
          << Describe(rs);
      EXPECT_NE(rs[r].status().code(), absl::StatusCode::kUnavailable)
          << what << ": a refusal, not a timeout" << Describe(rs);
    }
  }

  std::string Muonctl(const std::string& sub) {
    std::string out;
    const int rc = RunTool({Runfile("tools/muonctl/muonctl"), sub,
                            "--coordinator=" + cluster_.coordinator(),
                            "--job=" + cluster_.job(), "--dir=" + ckpt_dir_},
                           &out);
    EXPECT_EQ(rc, 0) << "muonctl " << sub << ": " << out;
    return out;
  }

  void Save() {
    const std::string out = Muonctl("save");
    ASSERT_TRUE(absl::StrContains(out, absl::StrCat("at step ", ref_.applied)))
        << out;
    ckpt_ref_ = ref_;
    ckpt_params_ = trainers_->SaveParams();
  }

  // muonctl load of the checkpoint; the trainers restore their params.
  void Load() {
    const std::string out = Muonctl("load");
    ASSERT_TRUE(absl::StrContains(
        out, absl::StrCat("next step id is ", ckpt_ref_.applied + 1)))
        << out;
    trainers_->RestoreParams(ckpt_params_);
    ref_ = ckpt_ref_;
  }

  // SIGKILL (then restart) or SIGSTOP (then SIGCONT after the comm timeout)
  // of a random daemon while step next() runs. Ranks that answered OK
  // applied it; the others must not have changed anything. Then the
  // recovery: re-register, load the checkpoint.
  void ProcessFault(bool kill_it) {
    const int victim = Uniform(0, kWorld - 1);
    const pid_t pid = cluster_.daemon_pid(victim);
    trainers_->FillGrads(next());
    const Reference before = ref_;
    Reference after = ref_;
    after.Apply(next());
    // The fault hits before the step (delay < 0) or while it runs.
    const int delay_ms = Uniform(-5, 20);
    std::vector<absl::StatusOr<v1::StepResponse>> rs;
    std::thread step;
    auto start_step = [&] {
      step = std::thread([&] { rs = trainers_->StepAll(next()); });
    };
    if (delay_ms >= 0) start_step();
    absl::SleepFor(absl::Milliseconds(std::max(delay_ms, 0)));
    if (kill_it) {
      cluster_.KillDaemon(victim);
      if (delay_ms < 0) start_step();
    } else {
      kill(pid, SIGSTOP);
      if (delay_ms < 0) start_step();
      absl::SleepFor(absl::Seconds(kCommTimeoutS + 1));
      kill(pid, SIGCONT);
    }
    step.join();
    Log(absl::StrCat(kill_it ? "killed" : "stopped", " rank ", victim,
                     delay_ms < 0 ? " before" : " during", " step ", next(),
                     Describe(rs)));
    for (int r = 0; r < kWorld; ++r) {
      if (kill_it && r == victim) continue;
      const Reference& want = rs[r].ok() ? after : before;
      ExpectRankEquals(r, want,
                       absl::StrCat("rank ", r, " after step ", next(),
                                    rs[r].ok() ? " (OK)" : " (failed)"));
    }
    if (kill_it) cluster_.StartDaemon(victim);
    absl::Status reg = trainers_->RegisterAll();
    ASSERT_TRUE(reg.ok()) << "re-registration after " << victim << ": " << reg;
    ASSERT_NO_FATAL_FAILURE(Load());
  }

  void ExpectRankEquals(int rank, const Reference& want,
                        const std::string& what) {
    const std::vector<float> got = trainers_->RankParams(rank);
    const std::vector<float> ref = want.RankParams(rank);
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(memcmp(&got[i], &ref[i], 4), 0)
          << what << ": element " << i << " = " << got[i] << ", reference "
          << ref[i] << " (reference applied steps 1.." << want.applied << ")";
    }
  }

  void ExpectMatchesReference(const std::string& when) {
    for (int r = 0; r < kWorld; ++r)
      ASSERT_NO_FATAL_FAILURE(
          ExpectRankEquals(r, ref_, absl::StrCat("rank ", r, " after ", when)));
  }

  std::mt19937 rng_;
  std::set<std::string> events_;
  Cluster cluster_;
  std::unique_ptr<ChaosTrainers> trainers_;
  Reference ref_ = Reference::Initial();
  Reference ckpt_ref_;
  std::vector<std::vector<float>> ckpt_params_;
  std::string ckpt_dir_;
  std::map<std::string, int> counts_;
};

TEST(ChaosTest, RandomFaultsKeepEveryRankEqualToTheReference) {
  const uint32_t seed = uint32_t(EnvInt("CHAOS_SEED", 16));
  const int steps = EnvInt("CHAOS_STEPS", 300);
  const char* env = getenv("CHAOS_EVENTS");
  std::set<std::string> events;
  for (absl::string_view e : absl::StrSplit(
           env != nullptr ? env : kDefaultEvents, ',', absl::SkipEmpty()))
    events.insert(std::string(e));
  fprintf(stderr, "[chaos] CHAOS_SEED=%u CHAOS_STEPS=%d CHAOS_EVENTS=%s\n",
          seed, steps, absl::StrJoin(events, ",").c_str());
  Chaos(seed, events).Run(steps);
}

}  // namespace
}  // namespace muond::reliability
