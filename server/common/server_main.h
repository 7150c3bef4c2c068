#pragma once
// The start every server main shares (muond-daemon, muond-coordinator).
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/common/health_status.h"

namespace muond {

// In order: SIGTERM/SIGINT to the shutdown watcher (InstallShutdownSignal-
// Handler), the usage message and --help filter (InstallServerUsage), --help
// itself (PrintServerHelp to stdout; returns false and the caller exits 0),
// flag parsing (absl::ParseCommandLine of argv with every dashed flag name
// in its snake_case spelling, flag_spelling.h, so --token-file is
// --token_file; --version prints "<server>
// <kMuondVersion>"), logging (InitServerLogging;
// `server` names the server in JSON log lines). Returns true when the server
// should go on starting.
bool BeginServerMain(int argc, char** argv, absl::string_view server,
                     absl::string_view usage,
                     const std::vector<std::string>& flag_sources);

// Raises the soft RLIMIT_NOFILE to the hard limit (open_files.h) and logs
// the limits, or a warning when it cannot. Each server calls it once its log
// lines carry their context (a daemon's job and rank).
void LogRaisedOpenFileLimit();

// A server's listening flags.
struct ListenerFlags {
  std::string listen;    // --listen
  std::string tls_cert;  // --tls_cert
  std::string tls_key;   // --tls_key
};

// The checks both servers make before binding: --listen's form
// (CheckListenAddress) and the TLS files (ServerCredentials; insecure
// credentials without --tls_cert). InvalidArgument naming the flag.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> CheckListener(
    const ListenerFlags& flags);

// Binds `listen` and starts serving `service`, with SO_REUSEPORT off
// (gRPC's default is on: a second server on a busy port would start too and
// the kernel would split the clients between the two; refuse the busy port
// instead) and messages up to `max_receive_bytes`. `bound_port`, when
// non-null, receives the TCP port bound (port 0 picks a free one).
// Beside `service` the server runs `health` (grpc.health.v1.Health; must
// outlive the server) and server reflection; neither asks for a token
// (docs/ARCHITECTURE.md "Security").
// Unavailable "cannot listen on <listen> (--listen: <busy_hint>)" when the
// address cannot be bound.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    const std::string& listen,
    const std::shared_ptr<grpc::ServerCredentials>& credentials,
    grpc::Service* service, HealthStatus* health, int max_receive_bytes,
    absl::string_view busy_hint, int* bound_port = nullptr);

}  // namespace muond
