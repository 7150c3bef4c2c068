// server/common/health_status: grpc.health.v1 over a real in-process gRPC
// server, read with the generated stub: Check, Watch transitions, and the
// bound on open Watch streams (one more than kMaxHealthWatches is
// RESOURCE_EXHAUSTED; a closed stream frees its slot).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/health_status.h"

namespace muond {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// A hang guard for each call, not a timed assertion.
std::chrono::system_clock::time_point Deadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(30);
}

class HealthWatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(&health_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials());
    stub_ = Health::NewStub(channel_);
  }
  void TearDown() override {
    health_.Shutdown();
    server_->Shutdown(Deadline());
  }

  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
  };

  std::unique_ptr<Stream> OpenWatch(const std::string& service) {
    auto stream = std::make_unique<Stream>();
    stream->context.set_deadline(Deadline());
    HealthCheckRequest request;
    request.set_service(service);
    stream->reader = stub_->Watch(&stream->context, request);
    return stream;
  }

  HealthStatus health_{"muond.v1.Test", /*serving=*/false};
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(HealthWatchTest, CheckAndWatchFollowTheStatus) {
  HealthCheckRequest request;
  HealthCheckResponse response;
  grpc::ClientContext check;
  ASSERT_TRUE(stub_->Check(&check, request, &response).ok());
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  grpc::ClientContext unknown;
  request.set_service("nope");
  EXPECT_EQ(stub_->Check(&unknown, request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);

  std::unique_ptr<Stream> watch = OpenWatch("muond.v1.Test");
  ASSERT_TRUE(watch->reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  health_.Set(true);
  ASSERT_TRUE(watch->reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  // Shutdown: the stream hears NOT_SERVING, then ends.
  health_.Shutdown();
  ASSERT_TRUE(watch->reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(watch->reader->Read(&response));
  EXPECT_TRUE(watch->reader->Finish().ok());
}

TEST_F(HealthWatchTest, WatchStreamsBeyondTheCapAreRefused) {
  std::vector<std::unique_ptr<Stream>> open;
  HealthCheckResponse response;
  for (int i = 0; i < kMaxHealthWatches; ++i) {
    open.push_back(OpenWatch(""));
    ASSERT_TRUE(open.back()->reader->Read(&response)) << "stream " << i;
    EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
  }
  std::unique_ptr<Stream> extra = OpenWatch("");
  EXPECT_FALSE(extra->reader->Read(&response));
  const grpc::Status refused = extra->reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.error_message();
  EXPECT_NE(refused.error_message().find(
                absl::StrCat(kMaxHealthWatches, " streams are open")),
            std::string::npos)
      << refused.error_message();
  // Check still answers while every slot is taken.
  grpc::ClientContext check;
  EXPECT_TRUE(stub_->Check(&check, HealthCheckRequest(), &response).ok());

  // A stream the client closes frees its slot (once the server's side has
  // ended: a few retries, each a fresh stream).
  open.front()->context.TryCancel();
  open.front()->reader->Finish();
  open.erase(open.begin());
  bool admitted = false;
  for (int attempt = 0; attempt < 100 && !admitted; ++attempt) {
    std::unique_ptr<Stream> again = OpenWatch("");
    admitted = again->reader->Read(&response);
    if (admitted) {
      open.push_back(std::move(again));
    } else {
      again->reader->Finish();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  EXPECT_TRUE(admitted);
  for (auto& stream : open) stream->context.TryCancel();
  for (auto& stream : open) stream->reader->Finish();
}

}  // namespace
}  // namespace muond
