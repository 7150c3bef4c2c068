// SaveState / LoadState through DaemonCore (StateTransactions): round trip,
// access, I/O without the locks, cancellation, the two phases and the rank's
// one pending transaction.
#include "tests/server/daemon/daemon_core_fixture.h"

namespace muond::daemon_core_test {
namespace {

TEST_F(DaemonCoreTest, SaveAndLoadStateRoundTrip) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  EXPECT_EQ(core_->SaveState(StateReq(path)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  fake_->state["w.momentum"][3] = 7.25f;
  absl::StatusOr<v1::SaveStateResponse> saved =
      core_->SaveState(StateReq(path));
  ASSERT_TRUE(saved.ok()) << saved.status();
  // The file is plain safetensors with per-shard keys.
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE(file->tensors.count("w/g0t0/momentum"));
  EXPECT_EQ(file->tensors["w/g0t0/momentum"].shape,
            (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(file->tensors["w/g0t0/momentum"].data[3], 7.25f);
  EXPECT_EQ(file->metadata["step_id"], "4");

  fake_->state["w.momentum"].assign(8, 0.0f);
  ASSERT_TRUE(core_->Step(StepReq(5)).ok());
  absl::StatusOr<v1::LoadStateResponse> loaded =
      core_->LoadState(LoadReq(path));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->step_id(), 4);
  EXPECT_EQ(fake_->state["w.momentum"][3], 7.25f);
  EXPECT_TRUE(core_->Step(StepReq(5)).ok());  // resumes after the saved step

  // A file lacking a tensor is refused, naming it; nothing changes.
  file->tensors.erase("v/g0t0/momentum");
  ASSERT_TRUE(WriteSafetensors(path, *file).ok());
  absl::Status bad = core_->LoadState(LoadReq(path)).status();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("'v/g0t0/momentum'"));
  EXPECT_EQ(core_->Status().last_step_id(), 5);
  unlink(path.c_str());
}

// Only the owner or the operator may save or load; the operator's client_id
// is the one derived from the daemon's token: the old constant and another
// token's id are refused, and a refusal never shows the operator's id.
TEST_F(DaemonCoreTest, SaveAndLoadAreTheOwnersOrTheOperators) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  ASSERT_TRUE(core_->SaveState(StateReq(path)).ok());
  const std::string operator_id = OperatorClientId(kJobToken);
  for (const std::string client :
       {std::string("intruder"), std::string(""),
        std::string("muonctl:operator"), OperatorClientId("another-token"),
        OperatorClientId("")}) {
    absl::Status save = core_->SaveState(StateReq(path, client)).status();
    EXPECT_EQ(save.code(), absl::StatusCode::kPermissionDenied) << save;
    absl::Status load = core_->LoadState(LoadReq(path, client)).status();
    EXPECT_EQ(load.code(), absl::StatusCode::kPermissionDenied) << load;
    EXPECT_THAT(load.message(), HasSubstr("'" + client.substr(0, 128) + "'"));
    EXPECT_THAT(load.message(), Not(HasSubstr(operator_id)));
  }
  v1::LoadStateRequest other_job = LoadReq(path);
  other_job.set_job_id("other");
  EXPECT_EQ(core_->LoadState(other_job).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(core_->SaveState(StateReq(path, operator_id)).ok());
  EXPECT_TRUE(core_->LoadState(LoadReq(path, operator_id)).ok());
  unlink(path.c_str());
}

// The file is written without the daemon's locks, so Health,
// Status and Step answer while a save is in its I/O (the cancellation check
// between tensors stands for a slow disk here).
TEST_F(DaemonCoreTest, HealthAndStepAnswerDuringASave) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  absl::Notification writing, release;
  std::thread save([&] {
    auto saved = core_->SaveState(StateReq(path), [&] {
      if (!writing.HasBeenNotified()) writing.Notify();
      release.WaitForNotification();
      return false;
    });
    EXPECT_TRUE(saved.ok()) << saved.status();
    EXPECT_EQ(saved->step_id(), 1);  // the state as of the copy
  });
  writing.WaitForNotification();
  EXPECT_TRUE(core_->Health().serving());
  EXPECT_EQ(core_->Status().last_step_id(), 1);
  EXPECT_TRUE(core_->Step(StepReq(2)).ok());
  release.Notify();
  save.join();
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata["step_id"], "1");
  unlink(path.c_str());
}

// A cancelled save (the daemon shutting down) stops and leaves no
// file.
TEST_F(DaemonCoreTest, CancelledSaveLeavesNoFile) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  absl::Status st =
      core_->SaveState(StateReq(path), [] { return true; }).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  EXPECT_NE(access(path.c_str(), F_OK), 0);
}

// The two phases. PREPARE changes nothing visible; COMMIT applies
// (save: the file appears); ABORT, a newer PREPARE or a step in between
// drop a prepared load.
TEST_F(DaemonCoreTest, TwoPhaseSaveAndLoad) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  fake_->state["w.momentum"][0] = 3.5f;
  auto phased = [&](auto req, v1::StatePhase phase, const std::string& id) {
    req.set_phase(phase);
    req.set_transaction_id(id);
    return req;
  };
  v1::SaveStateRequest save = StateReq(path);
  // A phase needs a transaction id.
  EXPECT_EQ(core_->SaveState(phased(save, v1::STATE_PHASE_PREPARE, ""))
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  auto prepared = core_->SaveState(phased(save, v1::STATE_PHASE_PREPARE, "t1"));
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(prepared->step_id(), 4);
  EXPECT_NE(access(path.c_str(), F_OK), 0) << "PREPARE put the file in place";
  EXPECT_EQ(core_->SaveState(phased(save, v1::STATE_PHASE_COMMIT, "t0"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(
      core_->SaveState(phased(save, v1::STATE_PHASE_COMMIT, "t1")).ok());
  EXPECT_EQ(access(path.c_str(), F_OK), 0);

  fake_->state["w.momentum"][0] = 0.0f;
  ASSERT_TRUE(core_->Step(StepReq(5)).ok());
  v1::LoadStateRequest load = LoadReq(path);
  auto staged = core_->LoadState(phased(load, v1::STATE_PHASE_PREPARE, "l1"));
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->step_id(), 4);
  EXPECT_EQ(staged->job_id(), "job");
  EXPECT_EQ(core_->Status().last_step_id(), 5);  // nothing applied yet
  EXPECT_EQ(fake_->state["w.momentum"][0], 0.0f);
  ASSERT_TRUE(core_->LoadState(phased(load, v1::STATE_PHASE_ABORT, "l1")).ok());
  EXPECT_EQ(core_->LoadState(phased(load, v1::STATE_PHASE_COMMIT, "l1"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  // A step between PREPARE and COMMIT: the staged state is stale.
  ASSERT_TRUE(
      core_->LoadState(phased(load, v1::STATE_PHASE_PREPARE, "l2")).ok());
  ASSERT_TRUE(core_->Step(StepReq(6)).ok());
  EXPECT_EQ(core_->LoadState(phased(load, v1::STATE_PHASE_COMMIT, "l2"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_->Status().last_step_id(), 6);
  ASSERT_TRUE(
      core_->LoadState(phased(load, v1::STATE_PHASE_PREPARE, "l3")).ok());
  auto committed = core_->LoadState(phased(load, v1::STATE_PHASE_COMMIT, "l3"));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(core_->Status().last_step_id(), 4);
  EXPECT_EQ(fake_->state["w.momentum"][0], 3.5f);
  unlink(path.c_str());
}

// A state the engine would refuse is refused at PREPARE, so a job's ranks
// (each prepares, then all commit) never commit it on some ranks only.
TEST_F(DaemonCoreTest, PrepareRefusesAStateTheEngineWouldRefuse) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(1)).ok());
  fake_->state["w.momentum"][3] = FakeMuon::kUnholdable;
  ASSERT_TRUE(core_->SaveState(StateReq(path)).ok());
  fake_->state["w.momentum"][3] = 0.25f;
  v1::LoadStateRequest load = LoadReq(path);
  load.set_phase(v1::STATE_PHASE_PREPARE);
  load.set_transaction_id("l1");
  absl::Status st = core_->LoadState(load).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("w.momentum"));
  load.set_phase(v1::STATE_PHASE_COMMIT);
  EXPECT_EQ(core_->LoadState(load).status().code(),
            absl::StatusCode::kFailedPrecondition);  // nothing was staged
  EXPECT_EQ(fake_->state["w.momentum"][3], 0.25f);
  unlink(path.c_str());
}

template <typename Request>
Request Phased(Request req, v1::StatePhase phase, const std::string& id) {
  req.set_phase(phase);
  req.set_transaction_id(id);
  return req;
}

// One pending transaction per rank. A second
// PREPARE (save or load) is refused naming the pending one; COMMIT/ABORT of
// another id leave it alone; so the first transaction still commits.
TEST_F(DaemonCoreTest, PendingTransactionBlocksAnotherPrepare) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  const std::string other = path + ".b";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  ASSERT_TRUE(core_->SaveState(StateReq(path)).ok());
  ASSERT_TRUE(core_->Step(StepReq(5)).ok());

  const v1::LoadStateRequest load = LoadReq(path);
  ASSERT_TRUE(
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "A")).ok());
  auto refused = core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "B"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("'A'"));
  // The age has a unit even under a millisecond ("0s", not "0").
  EXPECT_THAT(std::string(refused.status().message()),
              ContainsRegex("prepared [0-9.]+[a-z]+ ago"));
  // A save is refused too, and writes nothing.
  auto save_b =
      core_->SaveState(Phased(StateReq(other), v1::STATE_PHASE_PREPARE, "B"));
  EXPECT_EQ(save_b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(access(other.c_str(), F_OK), 0);
  // B's ABORT and a stray COMMIT do not touch A.
  EXPECT_TRUE(core_->LoadState(Phased(load, v1::STATE_PHASE_ABORT, "B")).ok());
  EXPECT_TRUE(
      core_->SaveState(Phased(StateReq(path), v1::STATE_PHASE_ABORT, "B"))
          .ok());
  EXPECT_EQ(core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "B"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  auto committed = core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "A"));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(core_->Status().last_step_id(), 4);

  // A pending save blocks a load PREPARE the same way; once committed, the
  // rank is free again.
  const v1::SaveStateRequest save = StateReq(other);
  ASSERT_TRUE(
      core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "C")).ok());
  EXPECT_EQ(core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "D"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(core_->LoadState(Phased(load, v1::STATE_PHASE_ABORT, "D")).ok());
  ASSERT_TRUE(core_->SaveState(Phased(save, v1::STATE_PHASE_COMMIT, "C")).ok());
  EXPECT_EQ(access(other.c_str(), F_OK), 0);
  ASSERT_TRUE(
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "D")).ok());
  ASSERT_TRUE(core_->LoadState(Phased(load, v1::STATE_PHASE_ABORT, "D")).ok());
  unlink(path.c_str());
  unlink(other.c_str());
}

// A load staged for a registration that is gone could never commit: Unregister
// drops it, so the next registration's PREPARE is not blocked (a trainer that
// re-registers to add a param group, then imports under a transaction).
TEST_F(DaemonCoreTest, UnregisterDropsThePendingTransaction) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  ASSERT_TRUE(core_->SaveState(StateReq(path)).ok());
  const v1::LoadStateRequest load = LoadReq(path);
  ASSERT_TRUE(
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "A")).ok());
  v1::UnregisterParamsRequest un;
  un.set_job_id("job");
  un.set_client_id("trainer0");
  ASSERT_TRUE(core_->Unregister(un).ok());
  link_.round_version = 2;
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(2, 0, 0));
  WaitForEngine();
  absl::StatusOr<v1::LoadStateResponse> b =
      core_->LoadState(Phased(load, v1::STATE_PHASE_PREPARE, "B"));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "A"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  absl::StatusOr<v1::LoadStateResponse> committed =
      core_->LoadState(Phased(load, v1::STATE_PHASE_COMMIT, "B"));
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(core_->Status().last_step_id(), 4);
  unlink(path.c_str());
}

// A transaction whose muonctl died between the phases stops blocking the
// rank after pending_transaction_max_age (200 ms here): the next PREPARE
// drops it (its temporary file too).
TEST_F(DaemonCoreTest, StalePendingTransactionIsDropped) {
  const std::string path = "/tmp/" + name_.substr(1) + ".safetensors";
  unlink(path.c_str());
  ASSERT_TRUE(core_->Register(Valid()).ok());
  core_->OnPlan(PlanFor(1, 0, 0));
  WaitForEngine();
  ASSERT_TRUE(core_->Step(StepReq(4)).ok());
  const v1::SaveStateRequest save = StateReq(path);
  ASSERT_TRUE(
      core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "A")).ok());
  EXPECT_EQ(core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "B"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(
      core_->SaveState(Phased(save, v1::STATE_PHASE_PREPARE, "B")).ok());
  EXPECT_EQ(core_->SaveState(Phased(save, v1::STATE_PHASE_COMMIT, "A"))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(core_->SaveState(Phased(save, v1::STATE_PHASE_COMMIT, "B")).ok());
  EXPECT_EQ(access(path.c_str(), F_OK), 0);
  unlink(path.c_str());
}

}  // namespace
}  // namespace muond::daemon_core_test
