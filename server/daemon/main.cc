// muond: the per-GPU (or per host-mode rank) optimizer daemon (DESIGN.md §1).
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/common/logging.h"
#include "server/common/unix_socket.h"
#include "server/daemon/coordinator_link.h"
#include "server/daemon/daemon_core.h"
#include "server/daemon/engine_factory.h"
#include "server/daemon/optimizer_service.h"

ABSL_FLAG(std::string, coordinator, "",
          "host:port of muond-coordinator (required)");
ABSL_FLAG(std::string, job_id, "", "Job id (required)");
ABSL_FLAG(int, rank, -1, "Global rank of this daemon in the job (required)");
ABSL_FLAG(int, world_size, -1, "Number of daemons in the job (required)");
ABSL_FLAG(std::string, listen, "",
          "Optimizer service address; default "
          "unix:///tmp/muond-<job>-<rank>.sock (created mode 0600)");
ABSL_FLAG(int, device, -1, "CUDA device to serve (CUDA IPC, NCCL)");
ABSL_FLAG(bool, host, false,
          "Host mode: CPU backend, shared memory, Gloo (default without "
          "--device)");
ABSL_FLAG(std::string, token, "", "Shared job token for the coordinator");
ABSL_FLAG(int, log_every, 100, "Log a one-line step summary every N steps");
ABSL_FLAG(std::string, gloo_hostname, "127.0.0.1",
          "Address Gloo listens on in host mode");
ABSL_FLAG(int, comm_timeout_s, 60,
          "Timeout of communicator rendezvous and collectives, seconds");
ABSL_FLAG(int, coordinator_timeout_s, 60,
          "How long to retry joining the coordinator at start, seconds");

namespace {
void OnSignal(int) { _exit(0); }
}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  muond::InitServerLogging(argv[0]);
  const std::string job = absl::GetFlag(FLAGS_job_id);
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world_size);
  const int device = absl::GetFlag(FLAGS_device);
  if (job.empty() || absl::GetFlag(FLAGS_coordinator).empty() || rank < 0 ||
      world < 1 || rank >= world) {
    LOG(ERROR) << "--job_id, --coordinator, --rank (0 <= rank < world) and "
                  "--world_size are required";
    return 2;
  }
  if (absl::GetFlag(FLAGS_host) && device >= 0) {
    LOG(ERROR) << "--host and --device are exclusive";
    return 2;
  }
  std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty()) {
    listen = absl::StrCat("unix:///tmp/muond-", job, "-", rank, ".sock");
  }
  std::string socket_path;
  const bool is_unix = muond::ParseUnixAddress(listen, &socket_path);
  if (is_unix) {
    absl::Status st = muond::PrepareUnixSocketPath(socket_path);
    if (!st.ok()) {
      LOG(ERROR) << st;
      return 1;
    }
  } else if (absl::GetFlag(FLAGS_token).empty()) {
    LOG(WARNING) << "listening on TCP " << listen
                 << " without a token: any local or remote process can "
                    "reach the Optimizer service";
  }

  muond::v1::JoinRequest join;
  join.set_job_id(job);
  join.set_rank(rank);
  join.set_world_size(world);
  char hostname[256] = {0};
  gethostname(hostname, sizeof(hostname) - 1);
  join.set_host(hostname);
  join.set_device(device >= 0 ? absl::StrCat("cuda:", device) : "cpu");
  join.set_address(listen);
  join.set_token(absl::GetFlag(FLAGS_token));
  muond::GrpcCoordinatorLink link(absl::GetFlag(FLAGS_coordinator), join);

  muond::DaemonConfig config;
  config.job_id = job;
  config.rank = rank;
  config.world_size = world;
  config.device = join.device();
  config.log_every = absl::GetFlag(FLAGS_log_every);
  muond::EngineOptions engine_options;
  engine_options.job_id = job;
  engine_options.device = device;
  engine_options.gloo_hostname = absl::GetFlag(FLAGS_gloo_hostname);
  engine_options.comm_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_comm_timeout_s));
  std::unique_ptr<muond::HandleOpener> opener =
      device >= 0 ? muond::MakeCudaHandleOpener(device)
                  : std::make_unique<muond::HandleOpener>();
  muond::DaemonCore core(config, std::move(opener), &link,
                         muond::MakeEngineFactory(engine_options, &link));
  muond::OptimizerService service(&core);

  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  // The socket file is created by bind: a restrictive umask closes the window
  // before the chmod below.
  const mode_t old_umask = umask(0077);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  umask(old_umask);
  if (server == nullptr) {
    LOG(ERROR) << "cannot listen on " << listen;
    return 1;
  }
  if (is_unix) {
    absl::Status st = muond::RestrictUnixSocket(socket_path);
    if (!st.ok()) {
      LOG(ERROR) << st;
      return 1;
    }
  }
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  absl::Status started =
      link.Start([&core](const muond::v1::Plan& plan) { core.OnPlan(plan); },
                 absl::Seconds(absl::GetFlag(FLAGS_coordinator_timeout_s)));
  if (!started.ok()) {
    LOG(ERROR) << started;
    return 1;
  }
  LOG(INFO) << "muond rank " << rank << "/" << world << " of job " << job
            << " serving on " << listen << " (" << config.device << ")";
  server->Wait();
  return 0;
}
