#include "server/common/server_main.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>

#include <iostream>
#include <utility>

#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/cli.h"
#include "server/common/flag_spelling.h"
#include "server/common/logging.h"
#include "server/common/open_files.h"
#include "server/common/shutdown.h"
#include "server/common/version.h"

namespace muond {

bool BeginServerMain(int argc, char** argv, absl::string_view server,
                     absl::string_view usage,
                     const std::vector<std::string>& flag_sources) {
  // SIGTERM/SIGINT from now on go to the shutdown watcher.
  InstallShutdownSignalHandler();
  // --version: "<server> <version>" rather than Abseil's build-mode text.
  InstallServerUsage(usage, flag_sources,
                     absl::StrCat(server, " ", kMuondVersion));
  // Both spellings of every flag: absl parses the snake_case one.
  std::vector<std::string> args =
      SnakeCaseFlags(std::vector<std::string>(argv + 1, argv + argc),
                     AbslFlagReadsNextArgument);
  args.insert(args.begin(), argv[0]);
  std::vector<char*> snake_argv;
  for (std::string& arg : args) snake_argv.push_back(arg.data());
  const int snake_argc = static_cast<int>(snake_argv.size());
  snake_argv.push_back(nullptr);  // argv[argc] is null, as main's
  if (WantsHelp(snake_argc, snake_argv.data())) {
    PrintServerHelp(std::cout, usage, flag_sources);
    return false;
  }
  absl::ParseCommandLine(snake_argc, snake_argv.data());
  InitServerLogging(argv[0], server);
  return true;
}

void LogRaisedOpenFileLimit() {
  // A daemon holds a descriptor per mapped shm region besides its sockets;
  // the usual soft limit (1024) is far below the hard one.
  absl::StatusOr<OpenFileLimit> limit = RaiseOpenFileLimit();
  if (limit.ok()) {
    LOG(INFO) << DescribeOpenFileLimit(*limit);
  } else {
    LOG(WARNING) << "open-file limit unchanged: " << limit.status().message();
  }
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> CheckListener(
    const ListenerFlags& flags) {
  if (absl::Status st = CheckListenAddress("--listen", flags.listen);
      !st.ok()) {
    return st;
  }
  return ServerCredentials(flags.tls_cert, flags.tls_key);
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& listen,
    const std::shared_ptr<grpc::ServerCredentials>& credentials,
    grpc::Service* service, HealthStatus* health, int max_receive_bytes,
    absl::string_view busy_hint, int* bound_port) {
  // Read by BuildAndStart; the plugin registers once per process. gRPC's
  // default health service stays off: `health` answers grpc.health.v1.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(max_receive_bytes);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(listen, credentials, bound_port);
  builder.RegisterService(service);
  builder.RegisterService(health);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || (bound_port != nullptr && *bound_port == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen,
                                               " (--listen: ", busy_hint, ")"));
  }
  return server;
}

}  // namespace muond
