// ExportState / ImportState through the real gRPC server (OptimizerService on
// a Unix socket) over a DaemonCore with the real step engine (host mode, one
// rank): a state larger than gRPC's default 4 MiB message limit streams both
// ways bitwise, every refused import changes nothing, and an import staged
// under a transaction is applied by COMMIT or dropped by ABORT.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "client/cpp/shm_region.h"
#include "core/comm/kv_store.h"
#include "gmock/gmock.h"
#include "server/common/step_id.h"
#include "server/daemon/daemon_core.h"
#include "server/daemon/engine_factory.h"
#include "server/daemon/optimizer_service.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

class NoCoordinator : public CoordinatorLink {
 public:
  absl::Status PublishManifest(const v1::PublishManifestRequest&) override {
    return absl::OkStatus();
  }
  void ReportTimings(const v1::ReportTimingsRequest&) override {}
};

// 1500 x 1000 fp32: 6 MB of momentum, over gRPC's default 4 MiB.
constexpr int64_t kRows = 1500, kCols = 1000, kBias = 16;

class StateRpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string tag = absl::StrCat(
        getpid(), "-",
        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    const size_t bytes = size_t(2 * (kRows * kCols + kBias)) * 4;
    region_ = *ShmRegion::Create("/muond-staterpc-" + tag, bytes);
    DaemonConfig config;
    config.job_id = "job";
    EngineOptions engine;
    engine.job_id = "job";
    core_ = std::make_unique<DaemonCore>(
        config, std::make_unique<HandleOpener>(), &link_,
        MakeEngineFactory(engine, std::make_shared<InMemoryKeyValueStore>()));
    // Idle imports are cancelled after 5 s here (kImportIdleTimeout: 60 s).
    service_ =
        std::make_unique<OptimizerService>(core_.get(), "", absl::Seconds(5));
    // /tmp: a Unix socket path must stay under 108 bytes.
    address_ = absl::StrCat("unix:///tmp/muond-staterpc-", tag, ".sock");
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder.SetMaxReceiveMessageSize(
        int(kMaxStateChunkBytes + kStateChunkOverheadBytes));
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.job_id = "job";
    options.client_id = "trainer0";
    options.rpc_timeout = absl::Seconds(60);
    client_ = *Client::Connect(address_, options);
    Register();
  }

  void TearDown() override {
    // Calls a refusal ended early need not be waited for.
    server_->Shutdown(std::chrono::system_clock::now());
    unlink(address_.substr(strlen("unix://")).c_str());
  }

  // Group "muon": "big" (kRows x kCols); group "adam" (AdamW): "bias".
  void Register() {
    float* base = static_cast<float*>(region_->data());
    const int64_t big = kRows * kCols;
    for (int64_t i = 0; i < 2 * (big + kBias); ++i) {
      base[i] = std::sin(0.001f * float(i));
    }
    v1::ParamGroup muon;
    muon.set_name("muon");
    muon.set_algorithm(v1::ALGORITHM_MUON);
    muon.mutable_muon()->set_lr(0.02);
    muon.mutable_muon()->set_momentum(0.95);
    muon.mutable_domain()->set_name("dense");
    muon.mutable_domain()->set_gtp_size(1);
    muon.mutable_domain()->set_tp_size(1);
    *muon.add_params() = MakeParam(
        "big", {kRows, kCols},
        *HostRef(*region_, base, v1::DTYPE_FP32, {kRows, kCols}),
        *HostRef(*region_, base + big, v1::DTYPE_FP32, {kRows, kCols}));
    v1::ParamGroup adam;
    adam.set_name("adam");
    adam.set_algorithm(v1::ALGORITHM_ADAMW);
    adam.mutable_adamw()->set_lr(0.01);
    *adam.mutable_domain() = muon.domain();
    *adam.add_params() = MakeParam(
        "bias", {kBias},
        *HostRef(*region_, base + 2 * big, v1::DTYPE_FP32, {kBias}),
        *HostRef(*region_, base + 2 * big + kBias, v1::DTYPE_FP32, {kBias}));
    ASSERT_TRUE(client_->Register({HostRegion(*region_)}, {muon, adam}).ok());
    v1::Plan plan;
    plan.set_job_id("job");
    plan.set_version(1);
    v1::GroupPlan* g = plan.add_groups();
    g->set_group("muon");
    g->add_homes();
    plan.add_groups()->set_group("adam");
    core_->OnPlan(plan);
    ASSERT_TRUE(client_->WaitForPlan(absl::Seconds(60)).ok());
  }

  // A state with every value distinct from the registered zeros.
  OptimizerState Distinct(const OptimizerState& like, int64_t step_id) {
    OptimizerState s = like;
    s.step_id = step_id;
    float x = 0.25f;
    for (auto& [name, values] : s.entries) {
      const bool count = name.find(".step") != std::string::npos &&
                         name.find(".step") + 5 == name.size();
      for (float& v : values) v = count ? 3.0f : (x += 0.001f);
    }
    return s;
  }

  OptimizerState Exported() {
    absl::StatusOr<OptimizerState> s = client_->ExportState();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : OptimizerState{};
  }

  void ExpectSame(const OptimizerState& a, const OptimizerState& b) {
    EXPECT_EQ(a.step_id, b.step_id);
    ASSERT_EQ(a.entries.size(), b.entries.size());
    for (const auto& [name, values] : a.entries) {
      ASSERT_TRUE(b.entries.contains(name)) << name;
      // Bitwise: memcmp, so -0.0 vs 0.0 or NaN payloads would differ too.
      const std::vector<float>& other = b.entries.at(name);
      ASSERT_EQ(values.size(), other.size()) << name;
      EXPECT_EQ(std::memcmp(values.data(), other.data(), values.size() * 4), 0)
          << name;
    }
  }

  std::string address_;
  std::unique_ptr<ShmRegion> region_;
  NoCoordinator link_;
  std::unique_ptr<DaemonCore> core_;
  std::unique_ptr<OptimizerService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(StateRpcTest, LargeStateRoundTripsBitwiseAndSetsTheStepId) {
  const OptimizerState fresh = Exported();
  EXPECT_EQ(fresh.step_id, -1);
  ASSERT_TRUE(fresh.entries.contains("big.momentum"));
  EXPECT_EQ(fresh.entries.at("big.momentum").size(), size_t(kRows * kCols));
  ASSERT_TRUE(fresh.entries.contains("bias.exp_avg"));
  ASSERT_TRUE(fresh.entries.contains("bias.exp_avg_sq"));

  const OptimizerState state = Distinct(fresh, 5);
  absl::StatusOr<v1::ImportStateResponse> imported =
      client_->ImportState(state, "", 3 << 20);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->num_entries(), int64_t(state.entries.size()));
  ExpectSame(state, Exported());
  // Other chunk sizes carry the same bytes.
  absl::StatusOr<OptimizerState> small = client_->ExportState(4096 + 4);
  ASSERT_TRUE(small.ok()) << small.status();
  ExpectSame(state, *small);

  // The next step id is the header's + 1.
  EXPECT_EQ(client_->Step(7).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client_->Step(6).ok());
  EXPECT_EQ(Exported().step_id, 6);
}

TEST_F(StateRpcTest, EveryRefusedImportChangesNothing) {
  const OptimizerState before = Distinct(Exported(), 2);
  ASSERT_TRUE(client_->ImportState(before).ok());
  const OptimizerState good = Distinct(before, 9);
  struct Case {
    std::string what;
    OptimizerState state;
    std::string client = "trainer0";
    std::string needle;
  };
  std::vector<Case> cases;
  {
    Case c{"missing entry", good, "trainer0", ""};
    c.state.entries.erase("bias.exp_avg");
    c.needle = "entry 'bias.exp_avg': missing";
    cases.push_back(c);
  }
  {
    Case c{"unknown entry", good, "trainer0", ""};
    c.state.entries["nope.momentum"] = {1.0f};
    c.needle = "entry 'nope.momentum': no registered param";
    cases.push_back(c);
  }
  {
    Case c{"wrong numel", good, "trainer0", ""};
    c.state.entries["bias.exp_avg"].push_back(1.0f);
    c.needle = "entry 'bias.exp_avg': numel 17, but the registered shard";
    cases.push_back(c);
  }
  {
    Case c{"non-finite value", good, "trainer0", ""};
    c.state.entries["big.momentum"][123] = NAN;
    c.needle = "'big.momentum' has the non-finite value nan at index 123";
    cases.push_back(c);
  }
  {
    Case c{"negative exp_avg_sq", good, "trainer0", ""};
    c.state.entries["bias.exp_avg_sq"][0] = -1.0f;
    c.needle = "'bias.exp_avg_sq' (exp_avg_sq) has the negative value";
    cases.push_back(c);
  }
  {
    Case c{"wrong owner", good, "intruder", ""};
    c.needle = "neither owns the params nor is the operator";
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    ClientOptions options = client_->options();
    options.client_id = c.client;
    std::unique_ptr<Client> sender = *Client::Connect(address_, options);
    absl::Status st = sender->ImportState(c.state, "", 1 << 16).status();
    EXPECT_FALSE(st.ok()) << c.what;
    EXPECT_THAT(st.message(), HasSubstr(c.needle)) << c.what;
    ExpectSame(before, Exported());
  }
  EXPECT_TRUE(client_->Step(3).ok());  // the step id did not move either
}

// The stream rules that the client never breaks: raw chunks.
TEST_F(StateRpcTest, RawStreamRulesRefuseAndChangeNothing) {
  const OptimizerState before = Exported();
  const std::vector<float>& bias = before.entries.at("bias.exp_avg");
  auto chunk = [](const std::string& entry, int64_t numel, int64_t offset,
                  std::string data) {
    v1::StateChunk c;
    c.set_entry(entry);
    c.set_numel(numel);
    c.set_offset(offset);
    c.set_data(std::move(data));
    return c;
  };
  const std::string half(size_t(kBias / 2) * 4, '\0');
  // Every other entry whole, so only the broken rule refuses.
  auto rest = [&] {
    std::vector<v1::StateChunk> chunks;
    for (const auto& [name, values] : before.entries) {
      if (name == "bias.exp_avg") continue;
      chunks.push_back(
          chunk(name, int64_t(values.size()), 0,
                std::string(reinterpret_cast<const char*>(values.data()),
                            values.size() * 4)));
    }
    return chunks;
  };
  struct Case {
    std::string what;
    std::vector<v1::StateChunk> bias_chunks;
    std::string needle;
    bool header = true;
  };
  std::vector<Case> cases = {
      {"duplicate",
       {chunk("bias.exp_avg", kBias, 0, half + half),
        chunk("bias.exp_avg", kBias, 0, half + half)},
       "entry 'bias.exp_avg': sent twice"},
      {"gap",
       {chunk("bias.exp_avg", kBias, 0, half),
        chunk("bias.exp_avg", kBias, 9, half)},
       "chunk at offset 9, expected 8"},
      {"overlap",
       {chunk("bias.exp_avg", kBias, 0, half),
        chunk("bias.exp_avg", kBias, 4, half)},
       "chunk at offset 4, expected 8"},
      {"past the end",
       {chunk("bias.exp_avg", kBias, 0, half + half + "abcd")},
       "runs past numel 16"},
      {"partial float",
       {chunk("bias.exp_avg", kBias, 0, "abc")},
       "data of 3 bytes is not whole fp32 values"},
      {"incomplete",
       {chunk("bias.exp_avg", kBias, 0, half)},
       "entry 'bias.exp_avg': incomplete: 8 of 16 values arrived"},
      {"no header",
       {chunk("bias.exp_avg", kBias, 0, half + half)},
       "first message must carry the header",
       false},
  };
  (void)bias;
  for (const Case& c : cases) {
    grpc::ClientContext context;
    v1::ImportStateResponse response;
    auto writer = client_->stub()->ImportState(&context, &response);
    if (c.header) {
      v1::StateChunk h;
      h.mutable_header()->set_job_id("job");
      h.mutable_header()->set_client_id("trainer0");
      h.mutable_header()->set_step_id(4);
      writer->Write(h);
    }
    std::vector<v1::StateChunk> chunks = c.bias_chunks;
    for (v1::StateChunk& r : rest()) chunks.push_back(r);
    for (const v1::StateChunk& x : chunks) {
      if (!writer->Write(x)) break;
    }
    writer->WritesDone();
    grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what;
    EXPECT_THAT(st.error_message(), HasSubstr(c.needle)) << c.what;
    ExpectSame(before, Exported());
  }
}

// Opens a raw ImportState stream and sends its header.
struct RawImport {
  grpc::ClientContext context;
  v1::ImportStateResponse response;
  std::unique_ptr<grpc::ClientWriter<v1::StateChunk>> writer;

  RawImport(Client& client, int64_t step_id) {
    writer = client.stub()->ImportState(&context, &response);
    v1::StateChunk h;
    h.mutable_header()->set_job_id("job");
    h.mutable_header()->set_client_id("trainer0");
    h.mutable_header()->set_step_id(step_id);
    writer->Write(h);
  }
  // Sends every entry whole, then ends the stream.
  grpc::Status Finish(const OptimizerState& state) {
    for (const auto& [name, values] : state.entries) {
      v1::StateChunk c;
      c.set_entry(name);
      c.set_numel(int64_t(values.size()));
      c.set_data(std::string(reinterpret_cast<const char*>(values.data()),
                             values.size() * 4));
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }
};

// A one-shot import whose header came before a step and whose end after it
// would roll this rank back while its peers keep the step: refused.
TEST_F(StateRpcTest, ImportIsAbortedWhenAStepRanDuringTheStream) {
  ASSERT_TRUE(client_->Step(0).ok());
  const OptimizerState before = Exported();
  RawImport raw(*client_, 10);
  absl::SleepFor(absl::Milliseconds(300));  // the daemon reads the header
  ASSERT_TRUE(client_->Step(1).ok());
  const OptimizerState stepped = Exported();
  grpc::Status st = raw.Finish(Distinct(before, 10));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ABORTED) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("step_id 0 at the header, 1 now"));
  ExpectSame(stepped, Exported());
  ASSERT_TRUE(client_->Step(2).ok());
}

// Import and Step share one bound (kMaxStepId): an import at it is accepted
// and a step past it refused, naming the range, as for a live daemon.
TEST_F(StateRpcTest, ImportAndStepShareTheStepIdBound) {
  const OptimizerState before = Exported();
  absl::Status top =
      client_->ImportState(Distinct(before, kMaxStepId + 1)).status();
  EXPECT_EQ(top.code(), absl::StatusCode::kInvalidArgument) << top;
  EXPECT_THAT(top.message(), HasSubstr("step_id"));
  ExpectSame(before, Exported());
  const OptimizerState last = Distinct(before, kMaxStepId);
  ASSERT_TRUE(client_->ImportState(last).ok());
  absl::Status next = client_->Step(kMaxStepId + 1).status();
  EXPECT_EQ(next.code(), absl::StatusCode::kInvalidArgument) << next;
  EXPECT_THAT(next.message(), HasSubstr("must be in [0, 4611686018427387903]"));
  ExpectSame(last, Exported());
}

// Polls `call` until it is OK (a freed slot is returned when the server's
// handler has ended, a moment after the client's side).
template <typename F>
absl::Status EventuallyOk(F call) {
  absl::Status st;
  for (int i = 0; i < 100; ++i) {
    st = call();
    if (st.ok()) return st;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return st;
}

// One import stream at a time: a second is refused at once naming the limit;
// the slot is freed when the stream ends, is cancelled, or idles too long.
TEST_F(StateRpcTest, OneImportStreamAtATime) {
  const OptimizerState before = Exported();
  const OptimizerState state = Distinct(before, 10);
  {
    RawImport first(*client_, 10);
    absl::SleepFor(absl::Milliseconds(300));  // the daemon reads the header
    RawImport second(*client_, 10);
    grpc::Status refused = second.Finish(state);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << refused.error_message();
    EXPECT_THAT(refused.error_message(), HasSubstr("the limit is 1"));
    grpc::Status ended = first.Finish(state);
    ASSERT_TRUE(ended.ok()) << ended.error_message();
  }
  ExpectSame(state, Exported());
  ASSERT_TRUE(client_->ImportState(Distinct(before, 11)).ok());  // freed
  {
    RawImport cancelled(*client_, 12);
    absl::SleepFor(absl::Milliseconds(300));
    cancelled.context.TryCancel();
  }
  EXPECT_TRUE(EventuallyOk([&] {
                return client_->ImportState(Distinct(before, 13)).status();
              }).ok());
  RawImport idle(*client_, 14);
  absl::SleepFor(absl::Seconds(6));  // past the 5 s idle bound
  EXPECT_TRUE(EventuallyOk([&] {
                return client_->ImportState(Distinct(before, 15)).status();
              }).ok());
  EXPECT_EQ(idle.Finish(state).error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(Exported().step_id, 15);
}

// Exports: kMaxExportStreams (2) at once; unread streams hold their slots
// until cancelled.
TEST_F(StateRpcTest, AtMostTwoExportStreams) {
  v1::ExportStateRequest request;
  request.mutable_header()->set_job_id("job");
  request.mutable_header()->set_client_id("trainer0");
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::StateChunk>>> unread;
  for (int i = 0; i < kMaxExportStreams; ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    unread.push_back(
        client_->stub()->ExportState(contexts.back().get(), request));
  }
  absl::SleepFor(absl::Milliseconds(500));  // both handlers are writing
  absl::Status refused = client_->ExportState().status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("the limit is 2"));
  for (auto& c : contexts) c->TryCancel();
  for (auto& r : unread) r->Finish();
  EXPECT_TRUE(
      EventuallyOk([&] { return client_->ExportState().status(); }).ok());
}

TEST_F(StateRpcTest, StagedImportAppliesOnCommitOnly) {
  const OptimizerState before = Exported();
  const OptimizerState staged = Distinct(before, 11);
  ASSERT_TRUE(client_->ImportState(staged, "t1").ok());
  ExpectSame(before, Exported());  // staged, not applied
  // One pending transaction per rank: another is refused, naming it.
  absl::Status second = client_->ImportState(staged, "t2").status();
  EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.message(), HasSubstr("'t1'"));
  ASSERT_TRUE(client_->AbortState("t1").ok());
  EXPECT_EQ(client_->CommitState("t1").status().code(),
            absl::StatusCode::kFailedPrecondition);
  ExpectSame(before, Exported());

  ASSERT_TRUE(client_->ImportState(staged, "t3").ok());
  absl::StatusOr<v1::LoadStateResponse> committed = client_->CommitState("t3");
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->step_id(), 11);
  ExpectSame(staged, Exported());
}

}  // namespace
}  // namespace muond
