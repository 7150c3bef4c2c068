// Client-side helpers: shm regions and TensorRefs for strided views; the
// client against an in-process fake daemon; the step channel's sizes and
// names, and the fallback to gRPC where a daemon has no channel.
#include "client/cpp/client.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/cpp/shm_region.h"
#include "client/cpp/step_channel.h"
#include "core/common/error_reason.h"
#include "proto/status_details.h"
#include "proto/step_channel_layout.h"
#include "tests/common/files.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

std::string UniqueName(const char* tag) {
  return "/muond-client-test-" + std::to_string(getpid()) + "-" + tag;
}

TEST(ShmRegion, CreateOpenShareBytesAndUnlinkOnDestroy) {
  const std::string name = UniqueName("a");
  auto region = ShmRegion::Create(name, 4096);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(ShmRegion::Create(name, 4096).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto p = (*region)->Allocate(100);
  ASSERT_TRUE(p.ok());
  std::memcpy(*p, "hello", 6);
  {
    auto other = ShmRegion::Open(name);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ((*other)->size(), 4096u);
    EXPECT_STREQ(static_cast<const char*>((*other)->data()), "hello");
  }
  // Alignment and exhaustion.
  auto q = (*region)->Allocate(10, 256);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(static_cast<char*>(*q) - static_cast<char*>((*region)->data()),
            256);
  EXPECT_EQ((*region)->Allocate(4096).status().code(),
            absl::StatusCode::kResourceExhausted);
  region->reset();
  EXPECT_EQ(ShmRegion::Open(name).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmRegion, BadNamesRefused) {
  EXPECT_EQ(ShmRegion::Create("noslash", 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmRegion::Create("/a/b", 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmRegion::Create(UniqueName("z"), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HostRef, ColumnBlockIsStridedViewWithOffset) {
  auto region = ShmRegion::Create(UniqueName("b"), 8 * 6 * 4);
  ASSERT_TRUE(region.ok());
  float* full = static_cast<float*>((*region)->data());  // 8 x 6 row-major
  // Columns [3, 6) of rows [2, 8): a 6 x 3 block with row stride 6.
  auto ref =
      HostRef(**region, full + 2 * 6 + 3, v1::DTYPE_FP32, {6, 3}, {6, 1});
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->region(), (*region)->name());
  EXPECT_EQ(ref->byte_offset(), (2 * 6 + 3) * 4u);
  EXPECT_EQ(ref->strides(0), 6);
  // Default strides are row-major.
  auto contiguous = HostRef(**region, full, v1::DTYPE_BF16, {4, 5});
  ASSERT_TRUE(contiguous.ok());
  EXPECT_EQ(contiguous->strides(0), 5);
  EXPECT_EQ(contiguous->strides(1), 1);
  // One row too many runs past the region.
  auto past =
      HostRef(**region, full + 2 * 6 + 3, v1::DTYPE_FP32, {7, 3}, {6, 1});
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(past.status().message(), HasSubstr("does not lie inside"));
  // Innermost stride must be 1.
  EXPECT_EQ(
      HostRef(**region, full, v1::DTYPE_FP32, {2, 2}, {6, 2}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(HostRegion, DeclaresTheWholeObjectUnderItsName) {
  auto region = ShmRegion::Create(UniqueName("d"), 4096);
  ASSERT_TRUE(region.ok());
  const v1::MemoryRegion declared = HostRegion(**region);
  EXPECT_EQ(declared.name(), (*region)->name());
  EXPECT_EQ(declared.kind(), v1::MEMORY_KIND_HOST_SHM);
  EXPECT_EQ(declared.shm_name(), (*region)->name());
  EXPECT_EQ(declared.byte_size(), 4096u);
}

TEST(CudaRef, OffsetIsFromTheAllocationBaseAndBoundedByIt) {
  // No device memory is needed: CudaRef only does pointer arithmetic on an
  // allocation CudaRegion described (here bytes [128, 640) of a host array).
  alignas(64) static char memory[1024];
  CudaAllocation allocation;
  allocation.base = memory + 128;
  allocation.region.set_name("gpu0");
  allocation.region.set_byte_size(512);
  // A 4 x 8 fp32 view with row stride 16 spans (3 * 16 + 7 + 1) * 4 = 224
  // bytes.
  auto ref =
      CudaRef(allocation, memory + 128 + 256, v1::DTYPE_FP32, {4, 8}, {16, 1});
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->region(), "gpu0");
  EXPECT_EQ(ref->byte_offset(), 256u);
  // From offset 320 it ends at 544 > 512.
  EXPECT_EQ(
      CudaRef(allocation, memory + 128 + 320, v1::DTYPE_FP32, {4, 8}, {16, 1})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  // Before the allocation's base.
  EXPECT_EQ(
      CudaRef(allocation, memory + 64, v1::DTYPE_FP32, {1}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(Client, ConnectNeedsJobIdAndStepFailsWithoutDaemon) {
  EXPECT_EQ(Client::Connect("unix:///nonexistent.sock", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ClientOptions options;
  options.job_id = "j";
  options.rpc_timeout = absl::Milliseconds(200);
  auto client =
      Client::Connect("unix:///tmp/muond-no-daemon-here.sock", options);
  ASSERT_TRUE(client.ok());
  EXPECT_FALSE((*client)->options().client_id.empty());
  EXPECT_FALSE((*client)->Step(1).ok());
}

// An in-process Optimizer service that answers every RPC with `reply` (as
// the daemon's service does, through ToGrpcStatus) and records the token and
// deadline each call arrived with.
class FakeDaemon : public v1::Optimizer::Service {
 public:
  explicit FakeDaemon(absl::Status reply) : reply_(std::move(reply)) {}

  grpc::Status Step(grpc::ServerContext* context,
                    const v1::StepRequest* request,
                    v1::StepResponse*) override {
    {
      absl::MutexLock lock(&mu_);
      steps_.push_back(*request);
    }
    return Answer(context);
  }
  grpc::Status RegisterParams(grpc::ServerContext* context,
                              const v1::RegisterParamsRequest*,
                              v1::RegisterParamsResponse*) override {
    return Answer(context);
  }
  grpc::Status GetStatus(grpc::ServerContext* context,
                         const v1::GetStatusRequest*,
                         v1::GetStatusResponse*) override {
    return Answer(context);
  }
  grpc::Status Health(grpc::ServerContext* context, const v1::HealthRequest*,
                      v1::HealthResponse*) override {
    return Answer(context);
  }
  // Unimplemented (an older daemon) unless answer_channel_version is set.
  grpc::Status OpenStepChannel(grpc::ServerContext*,
                               const v1::OpenStepChannelRequest* request,
                               v1::OpenStepChannelResponse* response) override {
    absl::MutexLock lock(&mu_);
    channel_names_.push_back(request->shm_name());
    if (!answer_channel_version_.has_value()) {
      return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
    }
    response->set_version(*answer_channel_version_);
    return grpc::Status::OK;
  }
  void answer_channel_version(uint32_t version) {
    absl::MutexLock lock(&mu_);
    answer_channel_version_ = version;
  }
  std::vector<std::string> channel_names() {
    absl::MutexLock lock(&mu_);
    return channel_names_;
  }

  std::vector<std::string> tokens() {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  std::vector<absl::Duration> deadlines() {
    absl::MutexLock lock(&mu_);
    return deadlines_;
  }
  std::vector<v1::StepRequest> steps() {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

 private:
  grpc::Status Answer(grpc::ServerContext* context) {
    absl::MutexLock lock(&mu_);
    auto token = context->client_metadata().find("x-muond-token");
    tokens_.push_back(
        token == context->client_metadata().end()
            ? ""
            : std::string(token->second.data(), token->second.size()));
    deadlines_.push_back(absl::FromChrono(context->deadline()) - absl::Now());
    return ToGrpcStatus(reply_);
  }

  const absl::Status reply_;
  absl::Mutex mu_;
  std::vector<std::string> tokens_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Duration> deadlines_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::StepRequest> steps_ ABSL_GUARDED_BY(mu_);
  std::optional<uint32_t> answer_channel_version_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> channel_names_ ABSL_GUARDED_BY(mu_);
};

class ClientAgainstFakeDaemon : public ::testing::Test {
 protected:
  void Serve(absl::Status reply) {
    daemon_ = std::make_unique<FakeDaemon>(std::move(reply));
    address_ = "unix://" + std::string("/tmp/muond-client-test-") +
               std::to_string(getpid()) + ".sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, grpc::InsecureServerCredentials());
    builder.RegisterService(daemon_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.job_id = "j";
    options.token = "secret";
    options.rpc_timeout = absl::Seconds(60);
    auto client = Client::Connect(address_, options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  std::unique_ptr<FakeDaemon> daemon_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
  std::string address_;
};

// The daemon's PEER_GONE reaches the caller typed and with the daemon's text,
// not rewritten as "this daemon is unreachable".
TEST_F(ClientAgainstFakeDaemon, StepKeepsTheDaemonsPeerGoneReason) {
  const std::string text =
      "step 7 failed: a peer daemon is gone: dead rank 3 (...)";
  Serve(WithErrorReason(absl::UnavailableError(text), ErrorReason::kPeerGone,
                        {{"step_id", "7"}}));
  absl::StatusOr<v1::StepResponse> r = client_->Step(7);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r.status().message(), text);
  EXPECT_TRUE(HasErrorReason(r.status(), ErrorReason::kPeerGone));
  EXPECT_EQ(GetErrorMetadata(r.status()), (ErrorMetadata{{"step_id", "7"}}));
}

// RefuseStep sends the step with only the trainer's reason (no overrides,
// nothing to apply) and returns the daemon's answer, the job's refusal.
TEST_F(ClientAgainstFakeDaemon, RefuseStepSendsTheReasonAndReturnsTheRefusal) {
  Serve(absl::FailedPreconditionError("step 4: the trainer refused it"));
  const absl::Status st =
      client_->RefuseStep(4, "grad of 'w1' has shape [3, 4], expected [4, 4]");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  const std::vector<v1::StepRequest> sent = daemon_->steps();
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].step_id(), 4);
  EXPECT_EQ(sent[0].job_id(), "j");
  EXPECT_EQ(sent[0].trainer_refusal(),
            "grad of 'w1' has shape [3, 4], expected [4, 4]");
  EXPECT_EQ(sent[0].overrides_size(), 0);
  // An empty reason would be a plain step: refused here, nothing sent.
  EXPECT_EQ(client_->RefuseStep(5, "").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(daemon_->steps().size(), 1u);
}

// A message longer than gRPC's metadata limits allow twice (it travels as
// grpc-message, percent-encoded, and inside the details) is cut on the wire
// instead of the whole status being replaced by RESOURCE_EXHAUSTED: the code,
// the reason, the start of the text and a note of the cut reach the caller.
// Before the cap, a 10 kB PEER_GONE message (e.g. long client-chosen domain
// names) arrived as "received metadata size exceeds hard limit" with no reason.
TEST_F(ClientAgainstFakeDaemon, LongMessageIsCutButCodeAndReasonArrive) {
  std::string text = "step 7 failed: a peer daemon is gone: domain ";
  while (text.size() < 20000) text += "\u00e9";  // 2 bytes each in UTF-8
  Serve(WithErrorReason(absl::UnavailableError(text), ErrorReason::kPeerGone,
                        {{"step_id", "7"}}));
  absl::StatusOr<v1::StepResponse> r = client_->Step(7);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_TRUE(HasErrorReason(r.status(), ErrorReason::kPeerGone));
  const std::string got(r.status().message());
  EXPECT_EQ(got.rfind(text.substr(0, 1000), 0), 0u) << got.substr(0, 80);
  EXPECT_NE(got.find("more bytes]"), std::string::npos) << got;
  EXPECT_LT(got.size(), kWireMessageBudgetBytes);
}

// UNAVAILABLE without a reason: the client names its daemon's address.
TEST_F(ClientAgainstFakeDaemon, StepUnavailableWithoutReasonNamesTheAddress) {
  Serve(absl::UnavailableError("socket closed"));
  absl::StatusOr<v1::StepResponse> r = client_->Step(1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(r.status().message(),
            "daemon at " + address_ + " is unreachable: socket closed");
  EXPECT_EQ(GetErrorReason(r.status()), ErrorReason::kUnspecified);
}

// Every RPC carries the token and a deadline (rpc_timeout; Health: 5 s) and
// returns the daemon's code, message and reason.
TEST_F(ClientAgainstFakeDaemon, EveryRpcSendsTokenAndDeadlineAndKeepsReason) {
  Serve(WithErrorReason(absl::NotFoundError("nothing here"),
                        ErrorReason::kNoPlanYet));
  const std::vector<absl::Status> results = {client_->Register({}, {}).status(),
                                             client_->Status().status(),
                                             client_->Health().status()};
  for (const absl::Status& st : results) {
    EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
    EXPECT_EQ(st.message(), "nothing here");
    EXPECT_TRUE(HasErrorReason(st, ErrorReason::kNoPlanYet)) << st;
  }
  EXPECT_THAT(daemon_->tokens(),
              ::testing::ElementsAre("secret", "secret", "secret"));
  const std::vector<absl::Duration> deadlines = daemon_->deadlines();
  ASSERT_EQ(deadlines.size(), 3u);
  // gRPC rounds a deadline up on the wire: bounds, not exact values.
  for (int i : {0, 1}) {
    EXPECT_GT(deadlines[i], absl::Seconds(30)) << i;
    EXPECT_LT(deadlines[i], absl::Seconds(61)) << i;
  }
  EXPECT_GT(deadlines[2], absl::Seconds(1));
  EXPECT_LT(deadlines[2], absl::Seconds(6));
}

bool ShmObjectExists(const std::string& name) {
  struct stat st;
  return stat(("/dev/shm" + name).c_str(), &st) == 0;
}

// A daemon without OpenStepChannel (an older one), and one speaking another
// layout version: no channel, nothing left in /dev/shm, steps over gRPC.
TEST_F(ClientAgainstFakeDaemon, NoStepChannelFromAnOlderDaemon) {
  Serve(absl::OkStatus());
  ASSERT_TRUE(client_->Register({}, {}).ok());
  EXPECT_FALSE(client_->HasStepChannel());
  EXPECT_EQ(client_->StepChannelStatus().code(),
            absl::StatusCode::kUnimplemented);
  daemon_->answer_channel_version(step_channel::kVersion + 1);
  ASSERT_TRUE(client_->Register({}, {}).ok());
  EXPECT_FALSE(client_->HasStepChannel());
  EXPECT_EQ(client_->StepChannelStatus().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      client_->StepChannelStatus().message(),
      HasSubstr(absl::StrCat("layout version ", step_channel::kVersion + 1)));
  const std::vector<std::string> names = daemon_->channel_names();
  ASSERT_EQ(names.size(), 2u);
  for (const std::string& name : names) {
    EXPECT_THAT(
        name, ::testing::StartsWith(absl::StrCat("/muond-j-", getpid(), "-")));
    EXPECT_FALSE(ShmObjectExists(name)) << name;
  }
  EXPECT_TRUE(client_->Step(1).ok());
  EXPECT_EQ(daemon_->steps().size(), 1u);
}

// With step_channel off the client never asks for one.
TEST_F(ClientAgainstFakeDaemon, StepChannelOffAsksForNone) {
  Serve(absl::OkStatus());
  ClientOptions options = client_->options();
  options.step_channel = false;
  auto client = Client::Connect(address_, options);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Register({}, {}).ok());
  EXPECT_FALSE((*client)->HasStepChannel());
  EXPECT_THAT((*client)->StepChannelStatus().message(),
              HasSubstr("step_channel is false"));
  EXPECT_TRUE(daemon_->channel_names().empty());
}

v1::ParamGroup GroupOfNames(const std::string& group,
                            const std::vector<std::string>& params) {
  v1::ParamGroup g;
  g.set_name(group);
  for (const std::string& name : params) g.add_params()->set_name(name);
  return g;
}

// Python's muond.step_channel.capacities, worked by hand: names + 16 bytes
// each, groups + 64, 64 KiB of slack, the refusal in the request; whole
// pages in [64 KiB, 64 MiB].
TEST(StepChannelCapacities, RoomForNamesOverridesAndTheRefusal) {
  const StepChannelCapacities empty = StepChannelCapacitiesFor({}, 16384);
  EXPECT_EQ(empty.request, 81920u);  // 65536 + 16384: 20 pages exactly
  EXPECT_EQ(empty.response, 65536u);
  // names 1016 + 17, override 65: request 83018 -> 21 pages, response 66569
  // -> 17 pages.
  const StepChannelCapacities some = StepChannelCapacitiesFor(
      {GroupOfNames("g", {std::string(1000, 'a'), "b"})}, 16384);
  EXPECT_EQ(some.request, 86016u);
  EXPECT_EQ(some.response, 69632u);
  // A skipped param is named "group/param" in an answer: a long group name
  // counts once per param there. names 10 x 17, prefixes 10 x 4001: response
  // 105716 -> 26 pages (without the prefixes 17).
  const StepChannelCapacities prefixed = StepChannelCapacitiesFor(
      {GroupOfNames(std::string(4000, 'G'), std::vector<std::string>(10, "p"))},
      0);
  EXPECT_EQ(prefixed.response, 26u * 4096);
  std::vector<std::string> many(20000, std::string(4000, 'x'));
  const StepChannelCapacities capped =
      StepChannelCapacitiesFor({GroupOfNames("g", many)}, 0);
  EXPECT_EQ(capped.request, step_channel::kMaxCapacity);
  EXPECT_EQ(capped.response, step_channel::kMaxCapacity);
}

TEST(StepChannelShmName, JobPrefixedPidTagAndA63BitNonce) {
  const std::string a = StepChannelShmName("run/7 a");
  const std::string b = StepChannelShmName("run/7 a");
  EXPECT_NE(a, b);
  const std::string prefix = absl::StrCat("/muond-run_7_a-", getpid(), "-");
  ASSERT_EQ(a.rfind(prefix, 0), 0u) << a;
  const std::string rest = a.substr(prefix.size());  // "<tag>-<nonce>"
  ASSERT_EQ(rest.size() > 9 && rest[8] == '-', true) << a;
  EXPECT_EQ(rest.substr(0, 8).find_first_not_of("0123456789abcdef"),
            std::string::npos)
      << a;
  const std::string nonce = rest.substr(9);
  EXPECT_EQ(nonce.find_first_not_of("0123456789"), std::string::npos) << a;
  EXPECT_LE(nonce.size(), 19u);  // < 2^63
  EXPECT_EQ(b.substr(0, prefix.size() + 8), a.substr(0, prefix.size() + 8));
  EXPECT_EQ(StepChannelShmName("").rfind("/muond-job-", 0), 0u);
}

TEST(Client, ConnectRefusesStepChannelBytesOffThePageGrid) {
  ClientOptions options;
  options.job_id = "j";
  options.step_channel_response_bytes = 65536 + 100;
  const absl::Status st =
      Client::Connect("unix:///nonexistent.sock", options).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(),
              HasSubstr("ClientOptions.step_channel_response_bytes 65636 must "
                        "be a multiple of 4096 in [65536, 67108864]"));
  options.step_channel_response_bytes = 0;
  options.step_channel_request_bytes = 4096;
  EXPECT_EQ(
      Client::Connect("unix:///nonexistent.sock", options).status().code(),
      absl::StatusCode::kInvalidArgument);
  options.step_channel_request_bytes = 65536;
  EXPECT_TRUE(Client::Connect("unix:///nonexistent.sock", options).ok());
}

// job_id and client_id travel in proto strings of every request: malformed
// UTF-8 would make each one unparsable on the daemon.
TEST(Client, ConnectRefusesIdsThatAreNotUtf8) {
  ClientOptions options;
  options.job_id = "job\xff";
  absl::Status st =
      Client::Connect("unix:///nonexistent.sock", options).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("ClientOptions.job_id 'job\\xff' must "
                                      "be valid UTF-8"));
  options.job_id = "j\xc3\xa9";        // U+00E9: fine
  options.client_id = "\xed\xa0\x80";  // a surrogate
  st = Client::Connect("unix:///nonexistent.sock", options).status();
  EXPECT_THAT(st.message(), HasSubstr("ClientOptions.client_id"));
  options.client_id = "trainer-\xf0\x9f\x98\x80";
  EXPECT_TRUE(Client::Connect("unix:///nonexistent.sock", options).ok());
}

// A fork while another thread creates or closes a step channel: the child
// has no descriptor of it (an untracked copy would keep the trainer's lock,
// hiding the trainer's death from the daemon). Creation and closing were
// not fenced from the fork handler, and most children of this loop kept one.
TEST(StepChannelFork, AChildForkedDuringCreateOrCloseHoldsNoChannel) {
  const std::string job = absl::StrCat("forkwin", getpid());
  const std::string prefix = absl::StrCat("/dev/shm/muond-", job, "-");
  std::atomic<bool> stop{false};
  std::atomic<int> forks{0}, kept{0};
  std::thread forker([&] {
    while (!stop.load()) {
      const pid_t child = fork();
      if (child == 0) _exit(testing::HoldsDescriptorOf(prefix) ? 1 : 0);
      int status = 0;
      waitpid(child, &status, 0);
      ++forks;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++kept;
    }
  });
  const StepChannelCapacities capacities = {step_channel::kMinCapacity,
                                            step_channel::kMinCapacity};
  for (int i = 0; i < 2000 && (i < 100 || forks.load() < 20); ++i) {
    const std::string name = StepChannelShmName(job);
    absl::StatusOr<std::unique_ptr<StepChannel>> channel =
        StepChannel::Create(name, capacities);
    shm_unlink(name.c_str());
    ASSERT_TRUE(channel.ok()) << channel.status();
  }
  stop.store(true);
  forker.join();
  EXPECT_GT(forks.load(), 0);
  EXPECT_EQ(kept.load(), 0) << "of " << forks.load() << " children";
}

}  // namespace
}  // namespace muond
