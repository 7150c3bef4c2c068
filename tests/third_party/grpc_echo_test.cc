// Proves the gRPC/protobuf wrappers and the proto codegen macro: an echo
// service over a Unix domain socket, the transport muond uses by default.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "echo.grpc.pb.h"

namespace {

class EchoService final : public muond::test::Echo::Service {
  grpc::Status Say(grpc::ServerContext*, const muond::test::EchoRequest* req,
                   muond::test::EchoReply* reply) override {
    reply->set_text("echo: " + req->text());
    return grpc::Status::OK;
  }
};

TEST(GrpcWrapper, EchoOverUnixSocket) {
  const std::string address =
      "unix:///tmp/muond-echo-test-" + std::to_string(getpid()) + ".sock";
  EchoService service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  auto stub = muond::test::Echo::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  muond::test::EchoRequest req;
  req.set_text("hello");
  muond::test::EchoReply reply;
  grpc::Status status = stub->Say(&ctx, req, &reply);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(reply.text(), "echo: hello");
  server->Shutdown();
}

}  // namespace
