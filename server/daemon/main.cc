// muond-daemon: the per-GPU (or per host-mode rank) optimizer daemon
// (docs/ARCHITECTURE.md "Processes").
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "core/backend/cuda_backend_options.h"
#include "core/backend/openblas_core.h"
#include "glog/logging.h"
#include "server/common/auth.h"
#include "server/common/cli.h"
#include "server/common/logging.h"
#include "server/common/metrics_http.h"
#include "server/common/operator_id.h"
#include "server/common/server_main.h"
#include "server/common/shutdown.h"
#include "server/common/unix_socket.h"
#include "server/daemon/cuda_device.h"
#include "server/daemon/daemon_core.h"
#include "server/daemon/engine_factory.h"
#include "server/daemon/instance_factory.h"
#include "server/daemon/optimizer_service.h"

namespace {
// The CUDA backend flags default to the environment variables that set the
// same switches before the flags existed, so existing launch scripts keep
// their behaviour; a flag given on the command line wins.
muond::CudaBackendOptions CudaDefaults() {
  return muond::CudaBackendOptionsFromLegacyEnvironment(
      [](const char* name) { return std::getenv(name); });
}
}  // namespace

ABSL_FLAG(std::string, coordinator, "",
          "host:port of muond-coordinator (required)");
ABSL_FLAG(std::string, job_id, "",
          "Job id (required; 1-64 characters of [A-Za-z0-9._-])");
ABSL_FLAG(int, rank, -1, "Global rank of this daemon in the job (required)");
ABSL_FLAG(int, world_size, -1, "Number of daemons in the job (required)");
ABSL_FLAG(std::string, listen, "",
          "Optimizer service address; default "
          "unix://$XDG_RUNTIME_DIR/muond/muond-<job>-<rank>.sock, or "
          "/tmp/muond-<uid>/... without XDG_RUNTIME_DIR (directory created "
          "0700, socket mode 0600). A TCP address (host:port) needs --token "
          "or --tls_cert/--tls_key");
ABSL_FLAG(int, device, -1,
          "CUDA device to serve (CUDA IPC, NCCL); must exist at startup");
ABSL_FLAG(bool, host, false,
          "Host mode: CPU backend, shared memory, Gloo (default without "
          "--device)");
ABSL_FLAG(std::string, token, "",
          "Shared job token: sent to the coordinator (Join and every call) "
          "and, on a TCP --listen, required from trainers in metadata "
          "('authorization: Bearer <token>' or 'x-muond-token'). Prefer "
          "--token_file: argv is visible to every user in ps");
ABSL_FLAG(std::string, token_file, "",
          "Read the shared token (see --token) from this file once at start: "
          "a regular file, not readable by others (chmod 600), non-empty");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate for a TLS TCP listener (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(std::string, coordinator_tls_ca, "",
          "PEM root certificate: connect to the coordinator over TLS");
ABSL_FLAG(int, testonly_commit_delay_ms, 0,
          "Tests only: sleep this long after a step's exchanges, before the "
          "job's commit vote (tests of a peer dying mid-step)");
ABSL_FLAG(int64_t, max_ns_workspace_bytes, 0,
          "Cap on the bytes of every Newton-Schulz workspace of the engine "
          "together (0: none); a batch (ns_batch_size) whose workspace does "
          "not fit under the cap or the device's free memory runs in smaller "
          "batches");
ABSL_FLAG(bool, skip_nonfinite, false,
          "Skip (instead of fail) a step whose gradients hold NaN/Inf; either "
          "way params and momentum stay unchanged and the params are named");
ABSL_FLAG(bool, allow_foreign_shm, false,
          "Map shm objects owned by other users too (by default the daemon "
          "maps only objects owned by its own effective uid, so a root "
          "daemon cannot be made to write another user's memory)");
ABSL_FLAG(int, max_step_channels, 64,
          "Step channels open at once (trainers on this host send steps "
          "through shared memory instead of the Step RPC, a futex wake-up "
          "instead of gRPC's: server/README.md \"Step channels\"); 0 turns "
          "them off");
ABSL_FLAG(double, step_channel_request_poll_ms, -1,
          "A step channel's thread polls for its trainer's next Step request "
          "from this many ms before it is due (the last answer plus the "
          "trainer's last forward and backward: its time from an answer to its "
          "next request) to as long after, instead of sleeping on the futex, "
          "so that its wake-up is off the step, and for a trainer's verdict as "
          "long before it sleeps: up to three times this of one core a step "
          "per channel. In [0, 10]; 0: sleep; -1 (default): 1 with --device, "
          "0 in host mode, whose step needs the cores (server/README.md "
          "\"Step channels\"; the trainer polls for the answer on its own: "
          "muond.torch.Muon's step_channel_poll_ms, muond::ClientOptions' "
          "step_channel_poll)");
ABSL_FLAG(int, log_every, 100, "Log a one-line step summary every N steps");
ABSL_FLAG(std::string, gloo_hostname, "127.0.0.1",
          "Address this daemon's Gloo listens on and advertises to its peers: "
          "host-mode collectives and, in GPU mode too, the job's commit vote; "
          "must be reachable from every other node");
ABSL_FLAG(int, comm_timeout_s, 60,
          "Timeout of communicator rendezvous and collectives, seconds");
ABSL_FLAG(int, coordinator_timeout_s, 60,
          "How long to retry joining the coordinator at start, seconds");
ABSL_FLAG(bool, cuda_graphs, CudaDefaults().cuda_graphs,
          "GPU mode: replay Newton-Schulz phases as CUDA graphs; "
          "--nocuda_graphs runs every kernel directly (debugging). Default: "
          "true, or false when the environment has MUOND_CUDA_GRAPHS=0");
ABSL_FLAG(bool, cublas_gemmex, CudaDefaults().cublas_gemmex,
          "GPU mode: GEMMs through the legacy cublasGemmEx path instead of "
          "cublasLt (A/B measurements). Default: false, or true when the "
          "environment has MUOND_CUBLAS_GEMMEX=1");
ABSL_FLAG(int, lt_autotune, CudaDefaults().lt_autotune,
          "GPU mode, diagnostic: time cublasLt's first N algorithms once per "
          "GEMM shape and keep the fastest (N > 1; clamped to 32); 0: "
          "cublasLt's heuristic pick. Default: 0, or MUOND_LT_AUTOTUNE from "
          "the environment");
ABSL_FLAG(std::string, sym_gemm_schedule, "auto",
          "GPU mode, H100/H200: the symmetric GEMM kernel's schedule, "
          "'cooperative' (both consumer warpgroups on one 128x128 tile), "
          "'pingpong' (a tile each, one's epilogue under the other's "
          "mainloop), 'wide' (both on one 128x256 tile) or 'auto' "
          "(wide for products of n >= 8192; ping-pong for products that "
          "add a c term (the NS polynomial's) from n = 2048, and for X X^T "
          "and X^T X where a batch's lower tiles fill two waves of the GPU; "
          "else cooperative)");

namespace {
constexpr char kUsage[] =
    "usage: muond-daemon --job_id=JOB --coordinator=HOST:PORT --rank=R "
    "--world_size=N\n"
    "             [--device=D | --host] [--listen=unix:///PATH | HOST:PORT] "
    "[flags...]\n"
    "The per-GPU (or per host-mode rank) optimizer daemon of one job.";
// Flags of muond-daemon itself (and the shared --v), not of its libraries.
const std::vector<std::string> kFlagSources = {"server/daemon/",
                                               "server/common/"};
}  // namespace

int main(int argc, char** argv) {
  // Before any thread or signal mask: OpenBLAS picks its kernels when it
  // loads, so better ones than its fallback need a fresh start.
  const std::string openblas_reexec = muond::ReexecWithBetterOpenBlasCore(argv);
  // SIGTERM/SIGINT from now on go to the shutdown watcher (below).
  if (!muond::BeginServerMain(argc, argv, "muond-daemon", kUsage,
                              kFlagSources)) {
    return 0;
  }
  const std::string job = absl::GetFlag(FLAGS_job_id);
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world_size);
  const int device = absl::GetFlag(FLAGS_device);
  if (absl::Status st = muond::CheckDaemonIdentityFlags(
          job, absl::GetFlag(FLAGS_coordinator), rank, world);
      !st.ok()) {
    LOG(ERROR) << st.message();
    return 2;
  }
  muond::SetLogJob(job, rank);
  muond::LogRaisedOpenFileLimit();
  // A malformed --coordinator would only fail at RegisterParams (Join keeps
  // retrying): refuse it at startup.
  if (absl::Status st = muond::CheckListenAddress(
          "--coordinator", absl::GetFlag(FLAGS_coordinator));
      !st.ok()) {
    LOG(ERROR) << st.message();
    return 2;
  }
  // A bad timeout would only fail when the step engine is built, after
  // RegisterParams: the trainer would wait for a plan that never comes.
  if (const int t = absl::GetFlag(FLAGS_comm_timeout_s); t < 1) {
    LOG(ERROR) << "--comm_timeout_s=" << t
               << " must be >= 1 (seconds a communicator waits for its peers)";
    return 2;
  }
  if (const int64_t b = absl::GetFlag(FLAGS_max_ns_workspace_bytes); b < 0) {
    LOG(ERROR) << "--max_ns_workspace_bytes=" << b
               << " must be >= 0 (0: no cap)";
    return 2;
  }
  if (const double p = absl::GetFlag(FLAGS_step_channel_request_poll_ms);
      p != -1 && !(p >= 0 && p <= 10)) {
    LOG(ERROR) << "--step_channel_request_poll_ms=" << p
               << " must be in [0, 10] (0: sleep) or -1 (the default)";
    return 2;
  }
  if (const int n = absl::GetFlag(FLAGS_max_step_channels); n < 0) {
    LOG(ERROR) << "--max_step_channels=" << n << " must be >= 0 (0: off)";
    return 2;
  }
  const std::optional<muond::SymGemmSchedule> sym_gemm_schedule =
      muond::ParseSymGemmSchedule(absl::GetFlag(FLAGS_sym_gemm_schedule));
  if (!sym_gemm_schedule.has_value()) {
    LOG(ERROR) << "--sym_gemm_schedule="
               << absl::GetFlag(FLAGS_sym_gemm_schedule)
               << " must be auto, cooperative, pingpong or wide";
    return 2;
  }
  if (absl::GetFlag(FLAGS_host) && device >= 0) {
    LOG(ERROR) << "--host and --device are exclusive";
    return 2;
  }
  if (device < -1) {
    LOG(ERROR) << "--device=" << device << " must be >= 0 (or omitted)";
    return 2;
  }
  // Fail before binding or joining: a daemon that cannot reach its device
  // must not report healthy to the coordinator.
  if (device >= 0) {
    if (absl::Status st = muond::CheckCudaDevice(device); !st.ok()) {
      LOG(ERROR) << st.message();
      return 1;
    }
  }
  std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty()) {
    // CheckDaemonIdentityFlags (CheckJobId) kept '/' out of `job`.
    absl::StatusOr<std::string> dir = muond::PrivateSocketDir();
    if (!dir.ok()) {
      LOG(ERROR) << dir.status();
      return 1;
    }
    listen = absl::StrCat("unix://", *dir, "/muond-", job, "-", rank, ".sock");
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      muond::CheckListener({listen, absl::GetFlag(FLAGS_tls_cert),
                            absl::GetFlag(FLAGS_tls_key)});
  if (!credentials.ok()) {
    LOG(ERROR) << credentials.status().message();
    return 2;
  }
  absl::StatusOr<std::string> token = muond::TokenFromFlags(
      absl::GetFlag(FLAGS_token), absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) {
    LOG(ERROR) << token.status().message();
    return 2;
  }
  std::string socket_path;
  const bool is_unix = muond::ParseUnixAddress(listen, &socket_path);
  if (is_unix) {
    absl::Status st = muond::PrepareUnixSocketPath(
        socket_path, absl::GetFlag(FLAGS_listen).empty()
                         ? "--listen (the default from --job_id)"
                         : "--listen");
    if (!st.ok()) {
      LOG(ERROR) << st;
      return 1;
    }
  } else if (token->empty() && absl::GetFlag(FLAGS_tls_cert).empty()) {
    LOG(ERROR)
        << "--listen=" << listen
        << " is TCP: give --token_file (trainers must send the token) or "
           "--tls_cert/--tls_key, or use a unix:// address";
    return 2;
  }

  auto metrics = std::make_shared<muond::DaemonMetrics>();

  muond::v1::JoinRequest join;
  join.set_job_id(job);
  join.set_rank(rank);
  join.set_world_size(world);
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  join.set_host(hostname);
  join.set_device(device >= 0 ? absl::StrCat("cuda:", device) : "cpu");
  join.set_address(listen);
  join.set_token(*token);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> coordinator_creds =
      muond::ChannelCredentials(absl::GetFlag(FLAGS_coordinator_tls_ca),
                                "--coordinator_tls_ca");
  if (!coordinator_creds.ok()) {
    LOG(ERROR) << coordinator_creds.status();
    return 2;
  }
  muond::InstanceSettings settings;
  settings.coordinator = absl::GetFlag(FLAGS_coordinator);
  settings.coordinator_credentials = *coordinator_creds;
  settings.join = join;
  settings.device = device;
  settings.allow_foreign_shm = absl::GetFlag(FLAGS_allow_foreign_shm);
  settings.coordinator_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_coordinator_timeout_s));
  muond::DaemonConfig& config = settings.config;
  config.job_id = job;
  config.rank = rank;
  config.world_size = world;
  config.device = join.device();
  config.log_every = absl::GetFlag(FLAGS_log_every);
  config.operator_client_id = muond::OperatorClientId(*token);
  // A rebuild is a rendezvous (up to one comm timeout) and may need another
  // epoch when a peer came late.
  config.comm_rebuild_wait =
      2 * absl::Seconds(absl::GetFlag(FLAGS_comm_timeout_s)) +
      absl::Seconds(10);
  config.metrics = metrics.get();
  config.validate_group = [device](const muond::v1::ParamGroup& group) {
    return muond::ValidateGroupForDevice(group, device);
  };
  muond::EngineOptions& engine_options = settings.engine;
  engine_options.device = device;
  engine_options.cuda.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
  engine_options.cuda.cublas_gemmex = absl::GetFlag(FLAGS_cublas_gemmex);
  engine_options.cuda.lt_autotune = absl::GetFlag(FLAGS_lt_autotune);
  engine_options.cuda.sym_gemm_schedule = *sym_gemm_schedule;
  engine_options.rank = rank;
  engine_options.world_size = world;
  engine_options.gloo_hostname = absl::GetFlag(FLAGS_gloo_hostname);
  engine_options.skip_nonfinite = absl::GetFlag(FLAGS_skip_nonfinite);
  engine_options.max_ns_workspace_bytes =
      absl::GetFlag(FLAGS_max_ns_workspace_bytes);
  engine_options.testonly_commit_delay_ms =
      absl::GetFlag(FLAGS_testonly_commit_delay_ms);
  engine_options.comm_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_comm_timeout_s));
  engine_options.metrics = metrics;
  // grpc.health.v1: the table's readiness rule (optimizer_table.h),
  // NOT_SERVING from shutdown on (the watcher below).
  muond::HealthStatus health(muond::v1::Optimizer::service_full_name(),
                             /*serving=*/false);
  muond::OptimizerTable table(muond::MakeInstanceFactory(std::move(settings)),
                              [&health](bool serving) { health.Set(serving); });
  if (!table.ok().ok()) {
    LOG(ERROR) << table.ok();
    return 1;
  }
  // Unix sockets are private by file mode; TCP trainers must send the token.
  muond::StepChannelOptions channels;
  channels.max_channels = absl::GetFlag(FLAGS_max_step_channels);
  channels.allow_foreign_shm = absl::GetFlag(FLAGS_allow_foreign_shm);
  const double poll_ms = absl::GetFlag(FLAGS_step_channel_request_poll_ms);
  channels.request_poll = absl::Microseconds(
      1000 * (poll_ms >= 0 ? poll_ms : (device >= 0 ? 1.0 : 0.0)));
  // A withdrawal must reach the peers waiting in the job vote before
  // their communicators time out.
  channels.verdict_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_comm_timeout_s)) / 2;
  channels.open_changed = [metrics](int open) {
    metrics->StepChannelsOpen(open);
  };
  muond::OptimizerService service(&table, is_unix ? std::string() : *token,
                                  muond::kImportIdleTimeout, channels);

  // A second muond-daemon on a busy TCP port must fail, not share the trainers'
  // connections with the first (StartGrpcServer). The socket file is
  // created by bind: umask 0177 makes it 0600 from the start (no window
  // before the chmod below).
  const mode_t old_umask = umask(0177);
  absl::StatusOr<std::unique_ptr<grpc::Server>> listening =
      muond::StartGrpcServer(
          listen, *credentials, &service, &health,
          // ImportState's largest chunk and its entry name fit.
          int(muond::kMaxStateChunkBytes + muond::kStateChunkOverheadBytes),
          "is the address in use?");
  umask(old_umask);
  if (!listening.ok()) {
    LOG(ERROR) << listening.status().message();
    return 1;
  }
  std::unique_ptr<grpc::Server> server = *std::move(listening);
  // Before `server` goes away: the core may still report readiness.
  absl::Cleanup detach_health = [&health] { health.Shutdown(); };
  const auto remove_socket = [&] {
    if (is_unix) unlink(socket_path.c_str());
  };
  if (is_unix) {
    absl::Status st = muond::RestrictUnixSocket(socket_path);
    if (!st.ok()) {
      LOG(ERROR) << st;
      server->Shutdown();
      remove_socket();
      return 1;
    }
  }
  // After listening, so a --metrics_port equal to --listen's port is
  // reported by the metrics bind (naming --metrics_port) rather than as a
  // busy --listen; before joining, so a joined daemon serves both.
  absl::StatusOr<std::unique_ptr<muond::MetricsHttpServer>> metrics_http =
      muond::StartMetricsHttpFromFlags(&metrics->registry());
  if (!metrics_http.ok()) {
    LOG(ERROR) << metrics_http.status().message();
    server->Shutdown();
    remove_socket();
    return absl::IsInvalidArgument(metrics_http.status()) ? 2 : 1;
  }
  // SIGTERM/SIGINT: stop serving, remove the socket file, exit 0. While
  // still joining (main is in link.Start), exit right after the cleanup.
  std::atomic<bool> serving{false};
  muond::ShutdownSignalWatcher watcher([&](int signum) {
    LOG(INFO) << "signal " << signum << ": shutting down";
    table.Shutdown();   // the Health RPC says it as grpc.health.v1 does:
    health.Shutdown();  // probes and Watch streams hear it before draining
    service.ShutdownStepChannels();
    // In-flight calls get 2 s, then are cancelled: a long SaveState/LoadState
    // stops at its next tensor (it checks the call's cancellation) instead of
    // holding the exit until the file is done.
    server->Shutdown(std::chrono::system_clock::now() +
                     std::chrono::seconds(2));
    remove_socket();
    if (!serving.load()) _exit(0);
  });
  absl::Status started = table.Default()->start(absl::InfiniteDuration());
  if (!started.ok()) {
    LOG(ERROR) << started;
    server->Shutdown();
    remove_socket();
    return 1;
  }
  serving.store(true);
  if (!openblas_reexec.empty()) LOG(WARNING) << openblas_reexec;
  LOG(INFO) << "OpenBLAS kernels: " << muond::DescribeOpenBlasKernels();
  LOG(INFO) << "muond-daemon rank " << rank << "/" << world << " of job " << job
            << " serving on " << listen << " (" << join.device() << ")";
  server->Wait();
  remove_socket();
  return 0;
}
