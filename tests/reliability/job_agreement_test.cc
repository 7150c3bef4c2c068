// Job agreement and "Health tells the truth": a step is accepted,
// skipped or refused by every rank of the job together, before anything
// changes; a step that fails after that (a peer dies) leaves params and
// momentum as before on every survivor. Real muond/muond-coordinator
// processes (tests/reliability/harness.h), host mode, small comm timeouts.
//
// Each rank registers the shared 2x2 group of the harness plus a group only
// it holds ("solo-r<rank>", a 1x1 domain), as muond.torch.Muon places AdamW
// and unsplittable params.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "server/common/safetensors.h"
#include "server/common/step_id.h"
#include "tests/common/muon_group.h"
#include "tests/reliability/harness.h"

namespace muond::reliability {
namespace {

constexpr int64_t kSoloRows = 8, kSoloCols = 4;

// One rank's solo group in a shm object of its own.
struct Solo {
  std::unique_ptr<ShmRegion> region;
  float* param = nullptr;
  float* grad = nullptr;
  v1::ParamGroup group;
};

Solo MakeSolo(int rank) {
  Solo s;
  static int counter = 0;
  s.region = *ShmRegion::Create(
      absl::StrCat("/muond-vote-", getpid(), "-", counter++, "-r", rank),
      1 << 14);
  s.param = static_cast<float*>(*s.region->Allocate(4 * kSoloRows * kSoloCols));
  s.grad = static_cast<float*>(*s.region->Allocate(4 * kSoloRows * kSoloCols));
  for (int64_t i = 0; i < kSoloRows * kSoloCols; ++i) {
    s.param[i] = Value("solo", 0, i, rank);
    s.grad[i] = Value("solo/grad", 1, i, rank);
  }
  s.group = testing::DenseMuonGroup(1, 1, 0, 0);
  s.group.set_name(absl::StrCat("solo-r", rank));
  s.group.mutable_domain()->set_name(absl::StrCat("solo-r", rank));
  auto pref =
      HostRef(*s.region, s.param, v1::DTYPE_FP32, {kSoloRows, kSoloCols});
  auto gref =
      HostRef(*s.region, s.grad, v1::DTYPE_FP32, {kSoloRows, kSoloCols});
  *s.group.add_params() =
      MakeParam("s", {kSoloRows, kSoloCols}, *pref, *gref, v1::ShardTags());
  return s;
}

// The harness's trainers' memory plus a solo group per rank, registered
// through clients of this job.
class Job {
 public:
  explicit Job(const Cluster& c) : cluster_(c), trainers_(c, "vote") {
    for (int r = 0; r < kWorld; ++r) solos_.push_back(MakeSolo(r));
  }

  absl::Status Register() {
    std::vector<absl::Status> st(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      auto client = cluster_.ConnectTrainer(r);
      if (!client.ok()) return client.status();
      clients_.push_back(*std::move(client));
    }
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        auto reg = clients_[r]->Register(
            {trainers_.Region(r), HostRegion(*solos_[r].region)},
            {trainers_.Group(r), solos_[r].group});
        st[r] = reg.ok() ? clients_[r]->WaitForPlan(absl::Seconds(30))
                         : reg.status();
      });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& s : st) {
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Step `id` on every rank concurrently; `overrides[r]` for rank r.
  std::vector<absl::StatusOr<v1::StepResponse>> StepAll(
      int64_t id, std::vector<std::vector<v1::GroupOverride>> overrides = {},
      std::vector<int64_t> ids = {}) {
    overrides.resize(kWorld);
    std::vector<absl::StatusOr<v1::StepResponse>> out(
        kWorld, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      const int64_t rid = ids.empty() ? id : ids[r];
      threads.emplace_back(
          [&, r, rid] { out[r] = clients_[r]->Step(rid, overrides[r]); });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  // Every param of every rank (the shared shards, then the solo params).
  std::vector<float> Params() const {
    std::vector<float> out = trainers_.Shards();
    for (const Solo& s : solos_) {
      out.insert(out.end(), s.param, s.param + kSoloRows * kSoloCols);
    }
    return out;
  }

  // After a failure: unregister what is left, register again on every rank
  // (a new round: new communicators).
  absl::Status Reregister() {
    for (auto& client : clients_) (void)client->Unregister();
    clients_.clear();
    return Register();
  }

  Trainers& trainers() { return trainers_; }
  Solo& solo(int r) { return solos_[r]; }
  Client& client(int r) { return *clients_[r]; }

 private:
  const Cluster& cluster_;
  Trainers trainers_;
  std::vector<Solo> solos_;
  std::vector<std::unique_ptr<Client>> clients_;
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every rank refused, fast (well under --comm_timeout_s 5: nobody waited for
// a peer), with `code`; the refusing rank's own message names `own`, the
// others name the refusing rank.
void ExpectRefusedEverywhere(
    const std::vector<absl::StatusOr<v1::StepResponse>>& results,
    absl::Duration took, absl::StatusCode code, int refuser,
    const std::string& own) {
  EXPECT_LT(took, absl::Seconds(3));
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    EXPECT_EQ(results[r].status().code(), code)
        << "rank " << r << ": " << results[r].status();
    const std::string want =
        r == refuser ? own : absl::StrCat("rank ", refuser, " (");
    EXPECT_TRUE(absl::StrContains(results[r].status().message(), want))
        << "rank " << r << ": " << results[r].status();
  }
}

TEST(JobAgreementTest, NanInOneRanksSoloGroupRefusesOnEveryRankAtOnce) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=5"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> after1 = job.Params();

  job.trainers().FillGrads(2);
  job.solo(1).grad[3] = std::numeric_limits<float>::quiet_NaN();
  const absl::Time start = absl::Now();
  auto results = job.StepAll(2);
  ExpectRefusedEverywhere(results, absl::Now() - start,
                          absl::StatusCode::kInvalidArgument, 1, "solo-r1");
  EXPECT_TRUE(SameBits(job.Params(), after1))
      << "a refused step changed params";
  // The communicators are healthy: the next step works with no
  // re-registration.
  job.solo(1).grad[3] = 0.5f;
  for (auto& r : job.StepAll(2)) EXPECT_TRUE(r.ok()) << r.status();
  for (int r = 0; r < kWorld; ++r) {
    auto h = job.client(r).Health();
    ASSERT_TRUE(h.ok());
    EXPECT_TRUE(h->has_plan()) << h->engine_error();
  }
}

TEST(JobAgreementTest, SkipNonFiniteSkipsOnEveryRankAndStepIdsStayEqual) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=5", "--skip_nonfinite"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> after1 = job.Params();
  job.solo(2).grad[0] = std::numeric_limits<float>::infinity();
  const absl::Time start = absl::Now();
  auto results = job.StepAll(2);
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].status();
    EXPECT_GT(results[r]->skipped_nonfinite_size(), 0) << "rank " << r;
  }
  EXPECT_TRUE(SameBits(job.Params(), after1))
      << "a skipped step changed params";
  for (int r = 0; r < kWorld; ++r) {
    auto s = job.client(r).Status();
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->last_step_id(), 2) << "rank " << r;
  }
  job.solo(2).grad[0] = 0.25f;
  for (auto& r : job.StepAll(3)) EXPECT_TRUE(r.ok()) << r.status();
}

TEST(JobAgreementTest, BadOverrideOrStepIdOnOneRankRefusesEveryRankAtOnce) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=5"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> after1 = job.Params();

  std::vector<std::vector<v1::GroupOverride>> overrides(kWorld);
  v1::GroupOverride bad;
  bad.set_group("muon");
  bad.set_lr(-1);
  overrides[2] = {bad};
  absl::Time start = absl::Now();
  ExpectRefusedEverywhere(job.StepAll(2, overrides), absl::Now() - start,
                          absl::StatusCode::kInvalidArgument, 2, "lr -1");
  // Bounded: 1e30 is refused too.
  bad.set_lr(1e30);
  overrides[2] = {bad};
  start = absl::Now();
  ExpectRefusedEverywhere(job.StepAll(2, overrides), absl::Now() - start,
                          absl::StatusCode::kInvalidArgument, 2, "<= 1000");
  // A step id out of sequence on one rank.
  start = absl::Now();
  ExpectRefusedEverywhere(job.StepAll(2, {}, {2, 2, 2, 7}), absl::Now() - start,
                          absl::StatusCode::kFailedPrecondition, 3,
                          "step_id 7");
  EXPECT_TRUE(SameBits(job.Params(), after1));
  for (auto& r : job.StepAll(2)) EXPECT_TRUE(r.ok()) << r.status();
}

// A replay votes with the job (JobVerdict::kReplay): when the ranks' last
// step ids differ ([1, 2, 2, 2] after rank 0 loads a step-1 checkpoint),
// Step 2 is a replay on ranks 1-3 and a new step on rank 0. Before, ranks 1-3
// answered from their record at once and rank 0 waited in its collectives
// for the comm timeout; now every rank refuses at once.
TEST(JobAgreementTest, ReplayOnSomeRanksOnlyIsRefusedOnEveryRankAtOnce) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=5"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::string ckpt = absl::StrCat(c.dir(), "/step1-r0.st");
  ASSERT_TRUE(job.client(0).SaveState(ckpt).ok());
  for (auto& r : job.StepAll(2)) ASSERT_TRUE(r.ok()) << r.status();
  // Every rank replaying is still answered from the record.
  for (auto& r : job.StepAll(2)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->replayed());
  }
  ASSERT_TRUE(job.client(0).LoadState(ckpt).ok());
  const std::vector<float> before = job.Params();
  const absl::Time start = absl::Now();
  auto results = job.StepAll(2);
  const absl::Duration took = absl::Now() - start;
  std::printf("mixed replay on rank 1: %s\n",
              results[1].status().ToString().c_str());
  EXPECT_LT(took, absl::Seconds(3));
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_FALSE(results[r].ok()) << "rank " << r;
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kFailedPrecondition)
        << "rank " << r << ": " << results[r].status();
    EXPECT_TRUE(absl::StrContains(results[r].status().message(),
                                  "ranks 1, 2, 3 had already applied"))
        << "rank " << r << ": " << results[r].status();
    EXPECT_TRUE(
        absl::StrContains(results[r].status().message(), "rank 0 had not"))
        << "rank " << r << ": " << results[r].status();
  }
  EXPECT_TRUE(SameBits(job.Params(), before));
}

// Client::RefuseStep (StepRequest.trainer_refusal) on one rank while the
// others step: every rank fails at once, the others naming that rank's
// trainer, nothing applied. The same holds for a retry of the last applied
// step (a replay on every daemon): before, the refusing daemon answered it
// from its record like its peers, so the peers' step ids advanced and the
// refusing trainer's did not.
TEST(JobAgreementTest, TrainerRefusalOfAStepOrAReplayFailsEveryRankAtOnce) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=5"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> after1 = job.Params();
  for (const int64_t id : {int64_t{2}, int64_t{1}}) {
    constexpr int kRefuser = 2;
    std::vector<absl::StatusOr<v1::StepResponse>> out(
        kWorld, absl::UnknownError("not run"));
    const absl::Time start = absl::Now();
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        if (r == kRefuser) {
          const absl::Status st =
              job.client(r).RefuseStep(id, "ValueError: 'ns_steps' x");
          if (st.ok()) {  // an answer as a step's (the bug: a replay)
            out[r] = v1::StepResponse();
          } else {
            out[r] = st;
          }
        } else {
          out[r] = job.client(r).Step(id);
        }
      });
    }
    for (auto& t : threads) t.join();
    SCOPED_TRACE(absl::StrCat("step ", id));
    ExpectRefusedEverywhere(out, absl::Now() - start,
                            absl::StatusCode::kFailedPrecondition, kRefuser,
                            "the trainer refused it");
    EXPECT_TRUE(SameBits(job.Params(), after1));
  }
  for (auto& r : job.StepAll(2)) EXPECT_TRUE(r.ok()) << r.status();
}

TEST(JobAgreementTest, StepIdsAreBounded) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=5"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  const int64_t max = std::numeric_limits<int64_t>::max();
  for (auto& r : job.StepAll(max)) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(r.status().message(), "step_id"))
        << r.status();
  }
  // 2^62 - 1 is the last step id (kMaxStepId): 2^62 is refused, as loads are.
  const int64_t top = kMaxStepId;
  for (auto& r : job.StepAll(top + 1)) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  }
  for (auto& r : job.StepAll(top)) EXPECT_TRUE(r.ok()) << r.status();
}

// Reads this rank's state file into name -> values.
std::map<std::string, std::vector<float>> ReadState(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  auto file = ReadSafetensors(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  for (auto& [name, t] : file->tensors) out[name] = t.data;
  return out;
}

TEST(JobAgreementTest, PeerKilledBeforeTheCommitLeavesSurvivorsUnchanged) {
  // Every rank waits 1.5 s between its exchanges and the commit vote; the
  // peer is killed inside that window.
  Cluster c({.daemon_flags = {"--comm_timeout_s=5",
                              "--testonly_commit_delay_ms=1500"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> after1 = job.Params();
  std::vector<std::map<std::string, std::vector<float>>> before(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    const std::string path = absl::StrCat(c.dir(), "/before", r, ".st");
    ASSERT_TRUE(job.client(r).SaveState(path).ok());
    before[r] = ReadState(path);
  }
  job.trainers().FillGrads(2);
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(800));
    c.KillDaemon(3);
  });
  auto results = job.StepAll(2);
  killer.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kUnavailable)
        << "rank " << r << ": " << results[r].status();
  }
  // Params: rank 3's memory is the trainer's, untouched by a dead daemon.
  EXPECT_TRUE(SameBits(job.Params(), after1))
      << "the failed step changed params on a survivor";
  for (int r = 0; r < 3; ++r) {
    const std::string path = absl::StrCat(c.dir(), "/after", r, ".st");
    ASSERT_TRUE(job.client(r).SaveState(path).ok());
    const auto after = ReadState(path);
    ASSERT_EQ(after.size(), before[r].size());
    for (const auto& [name, values] : before[r]) {
      EXPECT_TRUE(SameBits(after.at(name), values))
          << "rank " << r << " state " << name << " changed";
    }
    // Health tells the truth: no usable engine, and why.
    auto h = job.client(r).Health();
    ASSERT_TRUE(h.ok());
    EXPECT_FALSE(h->has_plan()) << "rank " << r;
    EXPECT_TRUE(absl::StrContains(h->engine_error(), "re-register"))
        << h->engine_error();
  }
  // Recovery without restarting the survivors: the dead daemon comes back,
  // every rank re-registers and loads the last checkpoint, and the step is
  // retried: the shared weights equal the reference of steps 1 and 2.
  c.StartDaemon(3);
  ASSERT_TRUE(c.WaitDaemonsLive(true, absl::Seconds(20)));
  ASSERT_TRUE(job.Reregister().ok());
  for (int r = 0; r < kWorld; ++r) {
    auto loaded =
        job.client(r).LoadState(absl::StrCat(c.dir(), "/before", r, ".st"));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
  }
  for (auto& r : job.StepAll(2)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> got = job.trainers().Shards();
  const std::vector<float> want = job.trainers().ReferenceShards({1, 2});
  EXPECT_TRUE(SameBits(got, want)) << "recovered step differs from reference";
}

TEST(JobAgreementTest, StoppedPeerIsReportedAsHungNotGone) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=3"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> after1 = job.Params();
  kill(c.daemon_pid(3), SIGSTOP);
  std::vector<absl::StatusOr<v1::StepResponse>> results(
      3, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { results[r] = job.client(r).Step(2); });
  }
  for (auto& t : threads) t.join();
  std::printf("rank 0 with rank 3 stopped: %s\n",
              results[0].status().ToString().c_str());
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kUnavailable)
        << "rank " << r << ": " << results[r].status();
    EXPECT_TRUE(absl::StrContains(results[r].status().message(),
                                  "did not answer in time"))
        << "rank " << r << ": " << results[r].status();
    auto h = job.client(r).Health();
    ASSERT_TRUE(h.ok());
    EXPECT_FALSE(h->has_plan());
    EXPECT_TRUE(absl::StrContains(h->engine_error(), "hung or stopped"))
        << h->engine_error();
  }
  EXPECT_TRUE(SameBits(job.Params(), after1));
  kill(c.daemon_pid(3), SIGCONT);
}

// A rank whose trainer never calls Step costs its peers ONE comm timeout
// (not one per collective: the domain agreement, then the job vote), and
// their answer names the phase that waited and why.
TEST(JobAgreementTest, RankThatNeverStepsCostsOneCommTimeout) {
  constexpr absl::Duration kTimeout = absl::Seconds(2);
  Cluster c({.daemon_flags = {"--comm_timeout_s=2"}});
  c.StartAll();
  Job job(c);
  ASSERT_TRUE(job.Register().ok());
  job.trainers().FillGrads(1);
  for (auto& r : job.StepAll(1)) ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<float> after1 = job.Params();
  std::vector<absl::StatusOr<v1::StepResponse>> results(
      3, absl::UnknownError("not run"));
  std::vector<absl::Duration> took(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {  // rank 3's trainer never calls Step 2
    threads.emplace_back([&, r] {
      const absl::Time start = absl::Now();
      results[r] = job.client(r).Step(2);
      took[r] = absl::Now() - start;
    });
  }
  for (auto& t : threads) t.join();
  std::printf("rank 0 with rank 3 never stepping: %s\n",
              results[0].status().ToString().c_str());
  for (int r = 0; r < 3; ++r) {
    EXPECT_LT(took[r], kTimeout * 1.5) << "rank " << r;
    EXPECT_EQ(results[r].status().code(), absl::StatusCode::kUnavailable)
        << "rank " << r << ": " << results[r].status();
    EXPECT_TRUE(absl::StrContains(results[r].status().message(),
                                  "did not join step 2 within"))
        << "rank " << r << ": " << results[r].status();
    EXPECT_TRUE(absl::StrContains(results[r].status().message(),
                                  "its trainer has not called Step"))
        << "rank " << r << ": " << results[r].status();
    auto h = job.client(r).Health();
    ASSERT_TRUE(h.ok());
    EXPECT_FALSE(h->has_plan());
  }
  EXPECT_TRUE(SameBits(job.Params(), after1)) << "a rank applied step 2";
  // The aborted communicators are rebuilt by the next registration.
  ASSERT_TRUE(job.Reregister().ok());
  job.trainers().FillGrads(2);
  for (auto& r : job.StepAll(2)) ASSERT_TRUE(r.ok()) << r.status();
}

}  // namespace
}  // namespace muond::reliability
