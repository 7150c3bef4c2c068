// Reliability tests through real processes (host mode, Gloo,
// 2x2): state save/restart/load, step-id rules, non-finite gradients, a dying
// daemon, a restarting coordinator, and access control. Every numeric check
// is bitwise against the single-process reference (harness.h).
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/backend/openblas_core.h"
#include "core/common/error_reason.h"
#include "server/common/safetensors.h"
#include "tests/reliability/harness.h"

namespace muond::reliability {
namespace {

std::vector<int> Steps(int first, int last) {
  std::vector<int> v;
  for (int s = first; s <= last; ++s) v.push_back(s);
  return v;
}

// Bitwise equality with the index of the first difference.
void ExpectBitwise(const std::vector<float>& got,
                   const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (memcmp(&got[i], &want[i], 4) != 0) {
      ADD_FAILURE() << what << ": element " << i << " = " << got[i] << ", want "
                    << want[i];
      return;
    }
  }
}

std::string Muonctl(const Cluster& c, const std::string& sub,
                    const std::string& dir, int* rc) {
  std::string out;
  std::vector<std::string> args = {Runfile("tools/muonctl/muonctl"), sub,
                                   "--coordinator=" + c.coordinator(),
                                   "--job=" + c.job()};
  if (!dir.empty()) args.push_back("--dir=" + dir);
  if (!c.options().token.empty())
    args.push_back("--token=" + c.options().token);
  *rc = RunTool(args, &out);
  return out;
}

// `after` 0: the coordinator's default activation margin (field unset).
v1::Plan Rebalance(const Cluster& c, bool inverted, int after) {
  auto stub = c.CoordinatorStub();
  v1::RebalanceRequest req;
  req.set_job_id(c.job());
  if (after > 0) req.set_activate_after_steps(after);
  for (const Weight& w : Weights()) {
    v1::ShapeTiming* t = req.add_cost_table();
    t->add_shape(w.rows);
    t->add_shape(w.cols);
    t->set_ns_us(inverted ? 1e6 / double(w.rows * w.cols)
                          : double(w.rows * w.cols));
    t->set_count(1);
  }
  v1::Plan plan;
  grpc::ClientContext ctx;
  c.AddToken(&ctx);
  grpc::Status st = stub->Rebalance(&ctx, req, &plan);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return plan;
}

// ------------------------------------------------------------------ state

// The daemons the harness starts inherit this process's kernels (its
// references are theirs bitwise), also where nothing set OPENBLAS_CORETYPE
// (a plain `bazel test`): none starts again with other ones.
TEST(ReliabilityTest, DaemonsRunTheReferencesOpenBlasKernels) {
  const char* set = getenv("OPENBLAS_CORETYPE");
  ASSERT_NE(set, nullptr);
  EXPECT_TRUE(absl::EqualsIgnoreCase(set, OpenBlasCore()))
      << set << " vs " << OpenBlasCore();
  EXPECT_EQ(BetterOpenBlasCore(), "");
}

TEST(ReliabilityTest, ResumeAfterRestartUnderAnotherPlanIsBitwise) {
  // Run A: 6 uninterrupted steps.
  std::vector<float> run_a;
  {
    Cluster a({});
    a.StartAll();
    Trainers t(a, "a");
    ASSERT_TRUE(t.RegisterAll().ok());
    ASSERT_TRUE(t.RunSteps(1, 6).ok());
    run_a = t.Shards();
    ExpectBitwise(run_a, t.ReferenceShards(Steps(1, 6)), "run A vs reference");
  }
  // Run B: 3 steps, muonctl save, kill every daemon, restart, another plan,
  // muonctl load, 3 more steps.
  Cluster b({});
  b.StartAll();
  Trainers t(b, "b");
  ASSERT_TRUE(t.RegisterAll().ok());
  ASSERT_TRUE(t.RunSteps(1, 3).ok());
  const std::string state = b.dir() + "/state";
  ASSERT_EQ(mkdir(state.c_str(), 0700), 0);
  int rc = 0;
  std::string out = Muonctl(b, "save", state, &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "saved 4 ranks at step 3")) << out;

  // Python's safetensors reads every file with its JSON metadata header.
  std::string py;
  rc = RunTool({"/usr/bin/env", "python3",
                Runfile("tests/reliability/read_state.py"), state, b.job()},
               &py);
  EXPECT_EQ(rc, 0) << py;
  EXPECT_TRUE(absl::StrContains(py, "4 files ok")) << py;

  for (int r = 0; r < kWorld; ++r) b.KillDaemon(r);
  ASSERT_TRUE(b.WaitDaemonsLive(false, absl::Seconds(10)));
  for (int r = 0; r < kWorld; ++r) b.StartDaemon(r);
  ASSERT_TRUE(t.RegisterAll().ok());
  // The restarted daemons' registration round got plan version 2 (fresh
  // rendezvous keys); the rebalance is version 3.
  const v1::Plan v2 = Rebalance(b, /*inverted=*/true, 0);
  ASSERT_EQ(v2.version(), 3);
  ASSERT_LE(v2.activate_at_step(), 6) << "v2 must take effect before step 6";
  out = Muonctl(b, "load", state, &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "next step id is 4")) << out;
  for (int r = 0; r < kWorld; ++r) {
    for (int i = 0; i < 500; ++i) {
      auto s = t.client(r).Status();
      if (s.ok() && s->latest_plan_version() >= 3) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  for (int s = 4; s <= 6; ++s) {
    t.FillGrads(s);
    auto results = t.StepAll(s);
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(results[r].ok()) << results[r].status();
      EXPECT_EQ(results[r]->plan_version(), s >= v2.activate_at_step() ? 3 : 2)
          << "v2 activates at " << v2.activate_at_step();
    }
  }
  ExpectBitwise(t.Shards(), run_a, "3 + restart + load + 3 vs 6 steps");

  // Load refuses mismatches, naming the tensor; nothing changes.
  const std::string f0 = state + "/rank0.safetensors";
  auto file = ReadSafetensors(f0);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata["job_id"], b.job());
  EXPECT_TRUE(absl::StrContains(file->metadata["domains"], "\"gtp_size\":2"));
  EXPECT_TRUE(absl::StrContains(file->metadata["hyperparameters"], "0.95"));
  const std::string key = "muon/col/g0t0/momentum";
  std::string keys;
  for (const auto& [k, v] : file->tensors) keys += k + " ";
  ASSERT_TRUE(file->tensors.count(key)) << "keys lack " << key << ": " << keys;
  {
    SafetensorsFile bad = *file;
    bad.tensors[key].shape = {bad.tensors[key].shape[1],
                              bad.tensors[key].shape[0]};
    ASSERT_TRUE(WriteSafetensors(state + "/shape.safetensors", bad).ok());
    auto st = t.client(0).LoadState(state + "/shape.safetensors");
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st.status().message(), key)) << st.status();
    EXPECT_TRUE(absl::StrContains(st.status().message(), "shape"));
  }
  {
    SafetensorsFile bad = *file;
    bad.tensors.erase(key);
    ASSERT_TRUE(WriteSafetensors(state + "/name.safetensors", bad).ok());
    auto st = t.client(0).LoadState(state + "/name.safetensors");
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st.status().message(), key)) << st.status();
  }
  {
    auto st = t.client(0).LoadState(state + "/rank1.safetensors");  // g0t1
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st.status().message(), "g0t")) << st.status();
  }
  {
    // dtype F16 for one tensor: a hand-written header.
    const std::string header =
        R"({"__metadata__":{"job_id":")" + b.job() +
        R"("},"muon/col/g0t0/momentum":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}})";
    std::ofstream f(state + "/dtype.safetensors", std::ios::binary);
    uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header << std::string(4, '\0');
    f.close();
    auto st = t.client(0).LoadState(state + "/dtype.safetensors");
    EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(st.status().message(), key)) << st.status();
    EXPECT_TRUE(absl::StrContains(st.status().message(), "F16")) << st.status();
  }
  // The refused loads changed nothing: the status still says step 6.
  auto s0 = t.client(0).Status();
  ASSERT_TRUE(s0.ok());
  EXPECT_EQ(s0->last_step_id(), 6);
}

// ------------------------------------------------------------------ steps

TEST(ReliabilityTest, StepIdRulesAndNonFiniteFailThroughTheDaemon) {
  Cluster c({});
  c.StartAll();
  Trainers t(c);
  ASSERT_TRUE(t.RegisterAll().ok());
  ASSERT_TRUE(t.RunSteps(1, 1).ok());
  const std::vector<float> after1 = t.Shards();
  // Repeat: answered from the record.
  t.FillGrads(7);
  for (auto& r : t.StepAll(1)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->replayed());
  }
  // Gap and backwards: refused.
  for (int64_t bad : {3, 0}) {
    for (auto& r : t.StepAll(bad)) {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition)
          << r.status();
    }
  }
  // NaN in "row": every rank fails naming it (domain-wide consensus).
  t.FillGrads(2, "row");
  for (auto& r : t.StepAll(2)) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(r.status().message(), "row")) << r.status();
  }
  ExpectBitwise(t.Shards(), after1, "params after refused steps");
  // Momentum unchanged too: step 2 with good grads equals the reference.
  ASSERT_TRUE(t.RunSteps(2, 2).ok());
  ExpectBitwise(t.Shards(), t.ReferenceShards({1, 2}), "after step 2");
}

TEST(ReliabilityTest, SkipNonFiniteFlagSkipsAndNamesParams) {
  Cluster c({.daemon_flags = {"--skip_nonfinite"}});
  c.StartAll();
  Trainers t(c);
  ASSERT_TRUE(t.RegisterAll().ok());
  ASSERT_TRUE(t.RunSteps(1, 1).ok());
  const std::vector<float> after1 = t.Shards();
  t.FillGrads(9, "pad");
  for (auto& r : t.StepAll(2)) {
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->skipped_nonfinite_size(), 1);
    EXPECT_TRUE(absl::StrContains(r->skipped_nonfinite(0), "pad"));
  }
  ExpectBitwise(t.Shards(), after1, "params after a skipped step");
  t.FillGrads(2);
  for (auto& r : t.StepAll(3)) ASSERT_TRUE(r.ok()) << r.status();
  ExpectBitwise(t.Shards(), t.ReferenceShards({1, 2}), "skip then step");
}

TEST(ReliabilityTest, DeadDaemonGivesUnavailableNamingTheRank) {
  Cluster c({.daemon_flags = {"--comm_timeout_s=5"}});
  c.StartAll();
  Trainers t(c);
  ASSERT_TRUE(t.RegisterAll().ok());
  ASSERT_TRUE(t.RunSteps(1, 1).ok());
  c.KillDaemon(3);
  t.FillGrads(2);
  // Twice: the first failure (transport) and the next (aborted comms).
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto results = t.StepAll(2);
    for (int r = 0; r < kWorld; ++r) {
      // UNAVAILABLE (not DEADLINE_EXCEEDED of the 30 s RPC): nothing hung.
      EXPECT_EQ(results[r].status().code(), absl::StatusCode::kUnavailable)
          << "rank " << r << ": " << results[r].status();
      if (r != 3) {
        EXPECT_TRUE(
            absl::StrContains(results[r].status().message(), "dead rank 3"))
            << "rank " << r << ": " << results[r].status();
        // The daemon's reason reached the client typed (gRPC ErrorInfo).
        EXPECT_TRUE(HasErrorReason(results[r].status(), ErrorReason::kPeerGone))
            << "rank " << r << ": " << results[r].status();
        EXPECT_EQ(GetErrorMetadata(results[r].status()),
                  (ErrorMetadata{{"step_id", "2"}}))
            << "rank " << r;
      } else {  // its own daemon is the dead one: no daemon gave a reason
        EXPECT_EQ(GetErrorReason(results[r].status()),
                  ErrorReason::kUnspecified);
      }
    }
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(c.DaemonAlive(r)) << r;
    EXPECT_TRUE(t.client(r).Health().ok()) << r;
  }
}

TEST(ReliabilityTest, CoordinatorRestartDaemonsKeepSteppingAndRejoin) {
  Cluster c({});
  c.StartAll();
  Trainers t(c);
  ASSERT_TRUE(t.RegisterAll().ok());
  ASSERT_TRUE(t.RunSteps(1, 1).ok());
  c.KillCoordinator();
  ASSERT_TRUE(t.RunSteps(2, 3).ok());
  c.StartCoordinator();  // same port
  ASSERT_TRUE(c.WaitDaemonsLive(true, absl::Seconds(30)))
      << "daemons did not re-join";
  // The daemons hold plan 1 and applied step 3: the restarted coordinator's
  // first plan is version 2 (not 1 again, which they would drop as old),
  // activating rebalance_activate_margin (20) steps after step 3.
  int rc = 0;
  const std::string out = Muonctl(c, "status", "", &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "plan version 2, activates at step 23"))
      << out;
  ASSERT_TRUE(t.RunSteps(4, 4).ok());
  // A rebalance on the restarted coordinator takes effect on every daemon.
  const v1::Plan moved = Rebalance(c, /*inverted=*/true, 1);
  ASSERT_EQ(moved.version(), 3);
  for (int r = 0; r < kWorld; ++r) {
    for (int i = 0; i < 500; ++i) {
      auto s = t.client(r).Status();
      if (s.ok() && s->latest_plan_version() >= 3) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  for (int s = 5; s <= 7; ++s) {
    t.FillGrads(s);
    auto results = t.StepAll(s);
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(results[r].ok()) << results[r].status();
      EXPECT_EQ(results[r]->plan_version(),
                s >= moved.activate_at_step() ? 3 : 1)
          << "step " << s << " rank " << r << "; v3 activates at "
          << moved.activate_at_step();
    }
  }
  ExpectBitwise(t.Shards(), t.ReferenceShards(Steps(1, 7)),
                "steps across a coordinator restart and a rebalance after it");
}

// The coordinator's SIGTERM ends the daemons' plan streams: it exits 0, and
// the daemons re-join a coordinator restarted on the same port.
TEST(ReliabilityTest, CoordinatorSigtermExitsAndDaemonsRejoin) {
  Cluster c({});
  c.StartAll();
  Trainers t(c);
  absl::Status registered = t.RegisterAll();
  ASSERT_TRUE(registered.ok()) << registered;
  ASSERT_TRUE(t.RunSteps(1, 1).ok());
  EXPECT_EQ(c.StopCoordinator(SIGTERM, absl::Seconds(30)), 0)
      << "muond-coordinator did not exit cleanly on SIGTERM with daemons "
         "watching plans";
  ASSERT_TRUE(t.RunSteps(2, 2).ok());
  c.StartCoordinator();  // same port
  ASSERT_TRUE(c.WaitDaemonsLive(true, absl::Seconds(30)))
      << "daemons did not re-join";
  ASSERT_TRUE(t.RunSteps(3, 3).ok());
  ExpectBitwise(t.Shards(), t.ReferenceShards(Steps(1, 3)),
                "steps across a coordinator SIGTERM + restart");
}

// ------------------------------------------------------------------ rounds

// The same live daemons serve two trainers one after the other; the second
// registration round gets a new plan version (fresh rendezvous keys) although
// the manifests are identical, and both runs equal the reference.
TEST(ReliabilityTest, SecondTrainerOnTheSameDaemonsGetsFreshRendezvous) {
  Cluster c({});
  c.StartAll();
  int64_t first_version = 0;
  {
    Trainers t(c, "first");
    ASSERT_TRUE(t.RegisterAll().ok());
    ASSERT_TRUE(t.RunSteps(1, 3).ok());
    ExpectBitwise(t.Shards(), t.ReferenceShards(Steps(1, 3)), "first trainer");
    auto s = t.client(0).Status();
    ASSERT_TRUE(s.ok()) << s.status();
    first_version = s->latest_plan_version();
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(t.client(r).Unregister().ok()) << r;
    }
  }
  for (int round = 0; round < 2; ++round) {
    Trainers t(c, absl::StrCat("next", round));
    ASSERT_TRUE(t.RegisterAll().ok()) << "round " << round;
    ASSERT_TRUE(t.RunSteps(1, 3).ok()) << "round " << round;
    ExpectBitwise(t.Shards(), t.ReferenceShards(Steps(1, 3)),
                  absl::StrCat("trainer of round ", round));
    for (int r = 0; r < kWorld; ++r) {
      auto s = t.client(r).Status();
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->latest_plan_version(), first_version + 1 + round) << r;
      ASSERT_TRUE(t.client(r).Unregister().ok()) << r;
    }
  }
}

// After a rebalance that activates late, restarted daemons with a fresh
// trainer stepping from 1 still have a plan for step 1.
TEST(ReliabilityTest, FreshTrainerAfterLateRebalanceStepsFromOne) {
  Cluster c({});
  c.StartAll();
  {
    Trainers t(c, "before");
    absl::Status registered = t.RegisterAll();
    ASSERT_TRUE(registered.ok()) << registered;
    ASSERT_TRUE(t.RunSteps(1, 2).ok());
    const v1::Plan late = Rebalance(c, /*inverted=*/true, 50);
    ASSERT_GT(late.activate_at_step(), 3);
  }
  for (int r = 0; r < kWorld; ++r) c.KillDaemon(r);
  ASSERT_TRUE(c.WaitDaemonsLive(false, absl::Seconds(10)));
  for (int r = 0; r < kWorld; ++r) c.StartDaemon(r);
  Trainers t(c, "after");
  absl::Status registered = t.RegisterAll();
  ASSERT_TRUE(registered.ok()) << registered;
  ASSERT_TRUE(t.RunSteps(1, 3).ok());
  ExpectBitwise(t.Shards(), t.ReferenceShards(Steps(1, 3)),
                "fresh trainer after a late rebalance");
}

// ------------------------------------------------------------------ access

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

TEST(ReliabilityTest, TokensSocketsAndOwnership) {
  Cluster c({.token = "s3cret"});
  c.StartAll();
  Trainers t(c);
  ASSERT_TRUE(t.RegisterAll().ok());  // daemons joined with the token
  ASSERT_TRUE(t.RunSteps(1, 1).ok());
  for (int r = 0; r < kWorld; ++r) {
    struct stat st;
    ASSERT_EQ(stat(c.socket(r).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  // Coordinator: KvGet/KvSet/ListDaemons need the token; Join checks it.
  auto stub = c.CoordinatorStub();
  for (const std::string token : {"", "wrong"}) {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("x-muond-token", token);
    v1::KvGetRequest get;
    get.set_job_id(c.job());
    get.set_key("comm/dense/v1/x");
    v1::KvGetResponse resp;
    EXPECT_EQ(stub->KvGet(&ctx, get, &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext ctx2;
    if (!token.empty()) ctx2.AddMetadata("authorization", "Bearer " + token);
    v1::KvSetRequest set;
    set.set_job_id(c.job());
    set.set_key("x");
    v1::KvSetResponse sresp;
    EXPECT_EQ(stub->KvSet(&ctx2, set, &sresp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext ctx3;
    v1::JoinRequest join;
    join.set_job_id(c.job());
    join.set_rank(0);
    join.set_world_size(kWorld);
    join.set_token(token);
    v1::JoinResponse jresp;
    EXPECT_EQ(stub->Join(&ctx3, join, &jresp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer s3cret");
    v1::ListDaemonsRequest req;
    req.set_job_id(c.job());
    v1::ListDaemonsResponse resp;
    EXPECT_TRUE(stub->ListDaemons(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.daemons_size(), kWorld);
  }
  // Ownership: another client id (or none) may not step or unregister.
  for (const std::string id : {"intruder", ""}) {
    auto raw = v1::Optimizer::NewStub(grpc::CreateChannel(
        "unix://" + c.socket(0), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::StepRequest step;
    step.set_job_id(c.job());
    step.set_step_id(2);
    step.set_client_id(id);
    v1::StepResponse resp;
    EXPECT_EQ(raw->Step(&ctx, step, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
    grpc::ClientContext ctx2;
    v1::UnregisterParamsRequest un;
    un.set_job_id(c.job());
    un.set_client_id(id);
    v1::UnregisterParamsResponse uresp;
    EXPECT_EQ(raw->UnregisterParams(&ctx2, un, &uresp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  ASSERT_TRUE(t.RunSteps(2, 2).ok());
  ExpectBitwise(t.Shards(), t.ReferenceShards({1, 2}), "owner still steps");

  // A TCP daemon without token or TLS refuses to start.
  const std::string tcp = absl::StrCat("127.0.0.1:", FreePort());
  std::string out;
  EXPECT_EQ(RunTool({Runfile("server/daemon/muond-daemon"), "--host",
                     "--coordinator=" + c.coordinator(), "--job_id=tcpjob",
                     "--rank=0", "--world_size=1", "--listen=" + tcp},
                    &out),
            2)
      << out;
  // With a token it serves only requests that carry it.
  pid_t pid =
      Spawn({Runfile("server/daemon/muond-daemon"), "--host",
             "--coordinator=" + c.coordinator(), "--job_id=tcpjob", "--rank=0",
             "--world_size=1", "--listen=" + tcp, "--token=s3cret"},
            c.dir() + "/tcp.log");
  auto tcp_stub = v1::Optimizer::NewStub(
      grpc::CreateChannel(tcp, grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-muond-token", "s3cret");
    ctx.set_wait_for_ready(true);  // the daemon may still be starting
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(20));
    v1::HealthResponse h;
    const grpc::Status with = tcp_stub->Health(&ctx, v1::HealthRequest(), &h);
    EXPECT_TRUE(with.ok()) << with.error_message();
  }
  {
    grpc::ClientContext ctx;
    v1::HealthResponse h;
    EXPECT_EQ(tcp_stub->Health(&ctx, v1::HealthRequest(), &h).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  kill(pid, SIGKILL);
  WaitExit(pid, absl::Seconds(5));

  // Default listen path: a private per-user directory, socket 0600.
  const std::string xdg = c.dir() + "/xdg";
  ASSERT_EQ(mkdir(xdg.c_str(), 0700), 0);
  setenv("XDG_RUNTIME_DIR", xdg.c_str(), 1);
  pid = Spawn({Runfile("server/daemon/muond-daemon"), "--host",
               "--coordinator=" + c.coordinator(), "--job_id=defjob",
               "--rank=0", "--world_size=1", "--token=s3cret"},
              c.dir() + "/default.log");
  unsetenv("XDG_RUNTIME_DIR");
  const std::string sock = xdg + "/muond/muond-defjob-0.sock";
  ASSERT_TRUE(WaitForFile(sock, absl::Seconds(10)));
  struct stat st;
  ASSERT_EQ(stat((xdg + "/muond").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat(sock.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  kill(pid, SIGKILL);
  WaitExit(pid, absl::Seconds(5));
}

}  // namespace
}  // namespace muond::reliability
