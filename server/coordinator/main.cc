// muond-coordinator: rendezvous store, manifests and NS-home plans for any
// number of jobs (docs/ARCHITECTURE.md "Processes", "Plans and their
// versions"). Listens on TCP or a Unix socket.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/cli.h"
#include "server/common/metrics_http.h"
#include "server/common/proto_convert.h"
#include "server/common/server_main.h"
#include "server/common/shutdown.h"
#include "server/coordinator/coordinator_core.h"
#include "server/coordinator/coordinator_service.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "Address to serve the Coordinator service on: host:port (port 0 "
          "picks a free one, see --port_file) or unix:/ABS/PATH. Without a "
          "token only this host may be served: a unix: socket, localhost, "
          "127.x.x.x or [::1] (see --insecure_allow_untokened_tcp)");
ABSL_FLAG(std::string, port_file, "",
          "When set, the bound port is written to this file once serving "
          "(and the file is removed on SIGTERM/SIGINT)");
ABSL_FLAG(std::string, token, "",
          "When set, every Join must carry this shared token and every other "
          "RPC must send it in metadata ('x-muond-token' or 'authorization: "
          "Bearer <token>'); without it a job still requires the token its "
          "first daemon joined with. Prefer --token_file: argv is visible to "
          "every user in ps");
ABSL_FLAG(std::string, token_file, "",
          "Read the shared token (see --token) from this file once at start: "
          "a regular file, not readable by others (chmod 600), non-empty");
ABSL_FLAG(int64_t, job_idle_expiry_s, 600,
          "Forget a job (world size, token, store, plans) when none of its "
          "daemons is live and no call named it for this many seconds");
ABSL_FLAG(int64_t, join_grace_s, 30,
          "A Join holds its rank this long before the daemon's plan stream "
          "opens; after that a join with no stream is replaced");
ABSL_FLAG(int, max_jobs, 64, "Jobs this coordinator holds at once");
ABSL_FLAG(int64_t, kv_max_value_bytes, 1 << 20,
          "Largest rendezvous value (KvSet)");
ABSL_FLAG(int64_t, kv_max_total_bytes, int64_t(256) << 20,
          "Rendezvous keys plus values over every job");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate: serve TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(bool, insecure_allow_untokened_tcp, false,
          "INSECURE: serve an address other hosts reach without a token (TLS "
          "or not). Every caller may then join, fill --max_jobs and hold job "
          "ids; ListDaemons hides daemon addresses from callers without a "
          "job token. For a trusted network only");

ABSL_FLAG(double, rebalance_threshold, 1.25,
          "Rebalance a job automatically (measured cost table) when the "
          "per-rank NS times of the latest reports show max/mean above this; "
          "0 = off");
ABSL_FLAG(int64_t, rebalance_interval_steps, 100,
          "At most one automatic rebalance check per this many steps, counted "
          "from the activation of the job's latest plan");
ABSL_FLAG(int64_t, rebalance_activate_margin, 20,
          "An automatic rebalance activates this many steps after the latest "
          "reported step (so every daemon has the plan before it)");

namespace {
constexpr char kUsage[] =
    "usage: muond-coordinator [--listen=HOST:PORT] [--port_file=FILE] "
    "[--token_file=FILE] [--tls_cert=PEM --tls_key=PEM] [flags...]\n"
    "Rendezvous store, manifests and NS-home plans for muond jobs.";
const std::vector<std::string> kFlagSources = {"server/coordinator/",
                                               "server/common/"};

}  // namespace

int main(int argc, char** argv) {
  // SIGTERM/SIGINT from now on go to the shutdown watcher (below).
  if (!muond::BeginServerMain(argc, argv, "muond-coordinator", kUsage,
                              kFlagSources)) {
    return 0;
  }
  muond::LogRaisedOpenFileLimit();

  muond::CoordinatorOptions options;
  absl::StatusOr<std::string> token = muond::TokenFromFlags(
      absl::GetFlag(FLAGS_token), absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) {
    LOG(ERROR) << token.status().message();
    return 2;
  }
  options.token = *std::move(token);
  // Durations are checked by Validate (> 0); the product cannot overflow for
  // any int64 number of seconds absl::Seconds accepts.
  options.job_idle_expiry =
      absl::Seconds(absl::GetFlag(FLAGS_job_idle_expiry_s));
  options.join_grace = absl::Seconds(absl::GetFlag(FLAGS_join_grace_s));
  options.max_jobs = absl::GetFlag(FLAGS_max_jobs);
  options.kv.max_value_bytes = absl::GetFlag(FLAGS_kv_max_value_bytes);
  options.kv.max_total_bytes = absl::GetFlag(FLAGS_kv_max_total_bytes);
  options.rebalance_threshold = absl::GetFlag(FLAGS_rebalance_threshold);
  options.rebalance_interval_steps =
      absl::GetFlag(FLAGS_rebalance_interval_steps);
  options.rebalance_activate_margin =
      absl::GetFlag(FLAGS_rebalance_activate_margin);
  options.planner = [](const muond::v1::GroupManifest& manifest,
                       muond::v1::CostModel model,
                       const muond::CostTable& costs) {
    return muond::PlanGroup(manifest, model, costs);
  };
  if (absl::Status st = options.Validate(); !st.ok()) {
    // The options are the flags of the same names (--max_wait aside).
    LOG(ERROR) << "--" << st.message();
    return 2;
  }
  muond::CoordinatorMetrics metrics;
  options.metrics = &metrics;
  muond::CoordinatorCore core(options);
  metrics.CollectJobsFrom([&core] { return core.MetricsSnapshot(); });
  const muond::ListenerFlags listener = {absl::GetFlag(FLAGS_listen),
                                         absl::GetFlag(FLAGS_tls_cert),
                                         absl::GetFlag(FLAGS_tls_key)};
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      muond::CheckListener(listener);
  if (!credentials.ok()) {
    LOG(ERROR) << credentials.status().message();
    return 2;
  }
  if (absl::Status st = muond::CheckUntokenedListen(
          listener.listen, !options.token.empty(),
          absl::GetFlag(FLAGS_insecure_allow_untokened_tcp));
      !st.ok()) {
    LOG(ERROR) << st.message();
    return 2;
  }
  // Untokened and reachable from other hosts (the opt-out above): nobody
  // proved anything, so daemon addresses are listed to job members only.
  const bool open_to_other_hosts =
      options.token.empty() && !muond::IsThisHostOnly(listener.listen);
  LOG_IF(WARNING, open_to_other_hosts)
      << "--insecure_allow_untokened_tcp: any host that reaches --listen="
      << listener.listen
      << " can join, fill --max_jobs and hold this coordinator's job ids";
  muond::CoordinatorService service(&core, options.token,
                                    /*addresses_need_token=*/
                                    open_to_other_hosts);

  // A second coordinator on the port would split the daemons between the
  // two (rendezvous and plans never meet): StartGrpcServer refuses it.
  int port = 0;
  // grpc.health.v1: SERVING once listening, NOT_SERVING from shutdown on.
  muond::HealthStatus health(muond::v1::Coordinator::service_full_name(),
                             /*serving=*/true);
  absl::StatusOr<std::unique_ptr<grpc::Server>> listening =
      muond::StartGrpcServer(
          listener.listen, *credentials, &service, &health, 16 << 20,
          "is the port in use, e.g. by another muond-coordinator?", &port);
  if (!listening.ok()) {
    LOG(ERROR) << listening.status().message();
    return 1;
  }
  std::unique_ptr<grpc::Server> server = *std::move(listening);
  // After listening, so a --metrics_port equal to --listen's port is
  // reported by the metrics bind (naming --metrics_port) rather than as a
  // busy --listen; before the port file, so a started coordinator serves
  // both. Declared after `core`: it stops serving before `core` goes away.
  absl::StatusOr<std::unique_ptr<muond::MetricsHttpServer>> metrics_http =
      muond::StartMetricsHttpFromFlags(&metrics.registry());
  if (!metrics_http.ok()) {
    LOG(ERROR) << metrics_http.status().message();
    server->Shutdown();
    return absl::IsInvalidArgument(metrics_http.status()) ? 2 : 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  // SIGTERM/SIGINT: stop serving; main then removes the port file.
  muond::ShutdownSignalWatcher watcher([&](int signum) {
    LOG(INFO) << "signal " << signum << ": shutting down";
    health.Shutdown();  // probes and Watch streams hear it before draining
    // Plan streams never end on their own: end them, and cancel whatever
    // call is still running after the deadline (a long KvGet).
    service.BeginShutdown();
    server->Shutdown(std::chrono::system_clock::now() +
                     std::chrono::seconds(2));
  });
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    FILE* f = fopen(tmp.c_str(), "w");
    if (f == nullptr || fprintf(f, "%d\n", port) < 0 || fclose(f) != 0 ||
        rename(tmp.c_str(), port_file.c_str()) != 0) {
      LOG(ERROR) << "cannot write --port_file " << port_file;
      server->Shutdown();
      return 1;
    }
  }
  // gRPC reports port 1 for a Unix socket: name the socket instead.
  const bool unix_socket = absl::StartsWith(listener.listen, "unix:");
  LOG(INFO) << "muond-coordinator serving on "
            << (unix_socket ? listener.listen : absl::StrCat("port ", port))
            << (options.token.empty() ? " (no token)" : " (token required)");
  // Without a token any local process may join a job first and fix its
  // token, or fill --max_jobs; the launcher always gives one, so say it
  // loudly here.
  LOG_IF(WARNING, options.token.empty())
      << "no --token_file: every process that reaches this coordinator can "
         "join, read and write its jobs (the first Join fixes a job's token) "
         "and fill --max_jobs; start it with --token_file";
  server->Wait();
  if (!port_file.empty()) unlink(port_file.c_str());
  return 0;
}
