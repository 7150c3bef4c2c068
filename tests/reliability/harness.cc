#include "tests/reliability/harness.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/openblas_core.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "server/daemon/engine_factory.h"
#include "tests/common/muon_group.h"

namespace muond::reliability {
namespace {

// The daemons this harness starts run this process's OpenBLAS kernels: its
// CPU backend computes the references they are held to bitwise, and a
// daemon that found OpenBLAS on its fallback kernels starts again with
// better ones (ReexecWithBetterOpenBlasCore), which round otherwise. Where
// OPENBLAS_CORETYPE is set (deploy/test.sh sets it for every test) this
// process runs it too and it stays. Before main: no thread reads the
// environment yet.
const bool kDaemonsRunOurKernels = [] {
  const char* set = getenv("OPENBLAS_CORETYPE");
  const std::string core = OpenBlasCore();
  if ((set == nullptr || *set == '\0') && !core.empty()) {
    setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  }
  return true;
}();

}  // namespace

int WaitExit(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (r < 0) return -1;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

bool WaitForFile(const std::string& path, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  struct stat st;
  while (stat(path.c_str(), &st) != 0) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

int RunTool(const std::vector<std::string>& args, std::string* output,
            absl::Duration timeout) {
  char path[] = "/tmp/muond-tool-XXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) return -1;
  close(fd);
  const int rc = WaitExit(Spawn(args, path), timeout);
  std::ifstream in(path);
  output->assign(std::istreambuf_iterator<char>(in), {});
  unlink(path);
  return rc;
}

// ---------------------------------------------------------------- Cluster

Cluster::Cluster(Options options)
    : options_(std::move(options)), daemons_(kWorld, -1) {
  char dir_template[] = "/tmp/muond-rel-XXXXXX";
  if (mkdtemp(dir_template) != nullptr) dir_ = dir_template;  // mode 0700
  static int counter = 0;
  job_ = absl::StrCat("rel", getpid(), "-", counter++);
}

Cluster::~Cluster() {
  for (int r = 0; r < kWorld; ++r) KillDaemon(r);
  KillCoordinator();
  if (!dir_.empty() && getenv("MUOND_KEEP_TEST_DIR") == nullptr) {
    std::string out;
    RunTool({"/bin/rm", "-rf", dir_}, &out);
  }
}

void Cluster::AddTokenFlag(std::vector<std::string>& args) const {
  if (options_.token.empty()) return;
  if (!options_.token_in_file) {
    args.push_back("--token=" + options_.token);
    return;
  }
  const std::string path = dir_ + "/token";
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd >= 0) {
    const std::string line = options_.token + "\n";
    (void)!write(fd, line.data(), line.size());
    close(fd);
  }
  args.push_back("--token_file=" + path);
}

void Cluster::StartCoordinator(int port) {
  if (port == 0) port = port_;
  std::vector<std::string> args = {
      Runfile("server/coordinator/muond-coordinator"),
      absl::StrCat("--listen=127.0.0.1:", port),
      "--port_file=" + dir_ + "/port"};
  AddTokenFlag(args);
  unlink((dir_ + "/port").c_str());
  coordinator_pid_ = Spawn(args, dir_ + "/coordinator.log");
  if (WaitForFile(dir_ + "/port", absl::Seconds(10))) {
    std::ifstream(dir_ + "/port") >> port_;
  }
}

void Cluster::KillCoordinator(int sig) {
  if (coordinator_pid_ <= 0) return;
  kill(coordinator_pid_, sig);
  WaitExit(coordinator_pid_, absl::Seconds(5));
  coordinator_pid_ = -1;
}

int Cluster::StopCoordinator(int sig, absl::Duration bound) {
  if (coordinator_pid_ <= 0) return -1;
  kill(coordinator_pid_, sig);
  const int code = WaitExit(coordinator_pid_, bound);
  coordinator_pid_ = -1;
  return code;
}

std::string Cluster::coordinator() const {
  return absl::StrCat("127.0.0.1:", port_);
}

std::string Cluster::socket(int rank) const {
  return absl::StrCat(dir_, "/d", rank, ".sock");
}

void Cluster::StartDaemon(int rank) {
  std::vector<std::string> args = {Runfile("server/daemon/muond-daemon"),
                                   "--host",
                                   "--coordinator=" + coordinator(),
                                   "--job_id=" + job_,
                                   absl::StrCat("--rank=", rank),
                                   absl::StrCat("--world_size=", kWorld),
                                   "--listen=unix://" + socket(rank),
                                   "--log_every=0",
                                   "--comm_timeout_s=10"};
  AddTokenFlag(args);
  for (const std::string& f : options_.daemon_flags) args.push_back(f);
  unlink(socket(rank).c_str());
  daemons_[rank] = Spawn(args, absl::StrCat(dir_, "/daemon", rank, ".log"));
  WaitForFile(socket(rank), absl::Seconds(10));
}

void Cluster::KillDaemon(int rank, int sig) {
  if (daemons_[rank] <= 0) return;
  kill(daemons_[rank], sig);
  WaitExit(daemons_[rank], absl::Seconds(5));
  daemons_[rank] = -1;
}

bool Cluster::DaemonAlive(int rank) {
  if (daemons_[rank] <= 0) return false;
  int status;
  return waitpid(daemons_[rank], &status, WNOHANG) == 0;
}

void Cluster::StartAll() {
  StartCoordinator();
  for (int r = 0; r < kWorld; ++r) StartDaemon(r);
}

std::unique_ptr<v1::Coordinator::Stub> Cluster::CoordinatorStub() const {
  return v1::Coordinator::NewStub(
      grpc::CreateChannel(coordinator(), grpc::InsecureChannelCredentials()));
}

void Cluster::AddToken(grpc::ClientContext* context) const {
  if (!options_.token.empty())
    context->AddMetadata("x-muond-token", options_.token);
}

bool Cluster::WaitDaemonsLive(bool live, absl::Duration timeout) {
  auto stub = CoordinatorStub();
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    AddToken(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(2));
    v1::ListDaemonsRequest req;
    req.set_job_id(job_);
    v1::ListDaemonsResponse resp;
    if (stub->ListDaemons(&ctx, req, &resp).ok()) {
      int n = 0;
      for (const v1::DaemonInfo& d : resp.daemons()) n += d.live() == live;
      if (n == (live ? kWorld : resp.daemons_size())) return true;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

// ---------------------------------------------------------------- weights

const std::vector<Weight>& Weights() {
  static const auto* w = new std::vector<Weight>{
      {"col", 32, 16, 0, true, 0},  {"row", 16, 32, 1, true, 0},
      {"pad", 36, 8, 0, true, 2},   {"rep", 8, 8, -1, false, 0},
      {"wide", 16, 24, 1, true, 0},
  };
  return *w;
}

float Value(const std::string& name, int step, int64_t i, int64_t j) {
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ uint8_t(c)) * 1099511628211ull;
  h ^= uint64_t(step) * 0x9E3779B97F4A7C15ull +
       uint64_t(i) * 0xBF58476D1CE4E5B9ull +
       uint64_t(j) * 0x94D049BB133111EBull;
  h ^= h >> 31;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 29;
  return float(int64_t(h % 20001) - 10000) / 10000.0f;
}

v1::ParamGroup BaseGroup(int g, int t) {
  return muond::testing::DenseMuonGroup(kG, kT, g, t);
}

// ---------------------------------------------------------------- Trainers

Trainers::Trainers(const Cluster& cluster, const std::string& tag)
    : cluster_(cluster) {
  static int counter = 0;
  const int id = counter++;
  for (int rank = 0; rank < kWorld; ++rank) {
    const int g = rank / kT, t = rank % kT;
    size_t bytes = 0;
    for (const Weight& w : Weights())
      bytes += 4 * (w.rows * w.cols * 2 + 64) + 4096;
    auto region = ShmRegion::Create(
        absl::StrCat("/muond-rel-", getpid(), "-",
                     absl::ToUnixMicros(absl::Now()) % 1000000007, "-", tag, id,
                     "-r", rank),
        bytes);
    regions_.push_back(std::move(*region));
    ShmRegion& reg = *regions_.back();
    v1::ParamGroup group = BaseGroup(g, t);
    std::vector<Buffers> bufs;
    for (const Weight& w : Weights()) {
      Buffers b;
      b.full_param = static_cast<float*>(*reg.Allocate(4 * w.rows * w.cols));
      b.full_grad = static_cast<float*>(*reg.Allocate(4 * w.rows * w.cols));
      b.shard = testing::ShardOf(w, kG, kT, g, t);
      for (int64_t i = 0; i < w.rows; ++i)
        for (int64_t j = 0; j < w.cols; ++j)
          b.full_param[i * w.cols + j] = Value(w.name, 0, i, j);
      absl::StatusOr<v1::TensorRef> pref, gref;
      if (w.pad > 0) {
        const size_t n = 4 * b.shard.nr * b.shard.nc;
        b.local_param = static_cast<float*>(*reg.Allocate(n));
        b.local_grad = static_cast<float*>(*reg.Allocate(n));
        memset(b.local_param, 0, n);
        for (int64_t i = 0; i < b.shard.real; ++i)
          memcpy(b.local_param + i * b.shard.nc,
                 b.full_param + (b.shard.r0 + i) * w.cols + b.shard.c0,
                 4 * b.shard.nc);
        pref = HostRef(reg, b.local_param, v1::DTYPE_FP32,
                       {b.shard.nr, b.shard.nc});
        gref = HostRef(reg, b.local_grad, v1::DTYPE_FP32,
                       {b.shard.nr, b.shard.nc});
      } else {
        const int64_t off = b.shard.r0 * w.cols + b.shard.c0;
        pref = HostRef(reg, b.full_param + off, v1::DTYPE_FP32,
                       {b.shard.nr, b.shard.nc}, {w.cols, 1});
        gref = HostRef(reg, b.full_grad + off, v1::DTYPE_FP32,
                       {b.shard.nr, b.shard.nc}, {w.cols, 1});
      }
      v1::ShardTags tags;
      tags.set_tensor_model_parallel(w.tp_dim >= 0);
      tags.set_partition_dim(w.tp_dim >= 0 ? w.tp_dim : 0);
      tags.set_is_gtp_weight_remat(w.gtp);
      tags.set_pad_length(w.pad);
      *group.add_params() =
          MakeParam(w.name, {w.rows, w.cols}, *pref, *gref, tags);
      bufs.push_back(b);
    }
    buffers_.push_back(std::move(bufs));
    groups_.push_back(std::move(group));
  }
}

absl::StatusOr<std::unique_ptr<Client>> Cluster::ConnectTrainer(
    int rank) const {
  ClientOptions options;
  options.job_id = job_;
  options.client_id = absl::StrCat("trainer", rank);
  options.rpc_timeout = absl::Seconds(30);
  return Client::Connect("unix://" + socket(rank), options);
}

std::string Cluster::ServerLogs(int tail_lines) const {
  std::string out;
  for (const std::string name :
       {"coordinator", "daemon0", "daemon1", "daemon2", "daemon3"}) {
    std::ifstream in(dir_ + "/" + name + ".log");
    std::deque<std::string> lines;
    for (std::string line; std::getline(in, line);) {
      lines.push_back(std::move(line));
      if (tail_lines > 0 && int(lines.size()) > tail_lines) lines.pop_front();
    }
    out += "\n--- " + name + ".log\n" + absl::StrJoin(lines, "\n");
  }
  return out;
}

Trainers::~Trainers() = default;

v1::ParamGroup Trainers::Group(int rank) const { return groups_[rank]; }

v1::MemoryRegion Trainers::Region(int rank) const {
  return HostRegion(*regions_[rank]);
}

absl::Status Trainers::RegisterAll(absl::Duration timeout) {
  clients_.clear();
  for (int r = 0; r < kWorld; ++r) {
    auto client = cluster_.ConnectTrainer(r);
    if (!client.ok()) return client.status();
    clients_.push_back(*std::move(client));
  }
  std::vector<absl::Status> st(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto reg = clients_[r]->Register({Region(r)}, {groups_[r]});
      st[r] = reg.ok() ? clients_[r]->WaitForPlan(timeout) : reg.status();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    if (!st[r].ok()) {
      return absl::Status(st[r].code(),
                          absl::StrCat("rank ", r, ": ", st[r].message(),
                                       cluster_.ServerLogs()));
    }
  }
  return absl::OkStatus();
}

void Trainers::FillGrads(int grad_step, const std::string& poison) {
  for (int rank = 0; rank < kWorld; ++rank) {
    for (size_t k = 0; k < Weights().size(); ++k) {
      const Weight& w = Weights()[k];
      Buffers& b = buffers_[rank][k];
      for (int64_t i = 0; i < w.rows; ++i)
        for (int64_t j = 0; j < w.cols; ++j)
          b.full_grad[i * w.cols + j] =
              Value(w.name + "/grad", grad_step, i, j);
      if (w.name == poison) {
        b.full_grad[b.shard.r0 * w.cols + b.shard.c0] =
            std::numeric_limits<float>::quiet_NaN();
      }
      if (b.local_grad != nullptr) {
        memset(b.local_grad, 0, 4 * b.shard.nr * b.shard.nc);
        for (int64_t i = 0; i < b.shard.real; ++i)
          memcpy(b.local_grad + i * b.shard.nc,
                 b.full_grad + (b.shard.r0 + i) * w.cols + b.shard.c0,
                 4 * b.shard.nc);
      }
    }
  }
}

std::vector<absl::StatusOr<v1::StepResponse>> Trainers::StepAll(int64_t id) {
  std::vector<absl::StatusOr<v1::StepResponse>> out(
      kWorld, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r)
    threads.emplace_back([&, r] { out[r] = clients_[r]->Step(id); });
  for (auto& t : threads) t.join();
  return out;
}

absl::Status Trainers::RunSteps(int64_t first, int64_t last) {
  for (int64_t s = first; s <= last; ++s) {
    FillGrads(int(s));
    auto results = StepAll(s);
    for (int r = 0; r < kWorld; ++r) {
      if (!results[r].ok()) {
        return absl::Status(results[r].status().code(),
                            absl::StrCat("step ", s, " rank ", r, ": ",
                                         results[r].status().message()));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<float> Trainers::Shards() const {
  std::vector<float> out;
  for (int rank = 0; rank < kWorld; ++rank) {
    for (size_t k = 0; k < Weights().size(); ++k) {
      const Weight& w = Weights()[k];
      const Buffers& b = buffers_[rank][k];
      for (int64_t i = 0; i < b.shard.real; ++i)
        for (int64_t j = 0; j < b.shard.nc; ++j)
          out.push_back(
              b.local_param != nullptr
                  ? b.local_param[i * b.shard.nc + j]
                  : b.full_param[(b.shard.r0 + i) * w.cols + b.shard.c0 + j]);
    }
  }
  return out;
}

std::vector<float> Trainers::ReferenceShards(
    const std::vector<int>& grad_steps) const {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  absl::StatusOr<MuonOptions> muon = MuonOptionsFromProto(BaseGroup(0, 0));
  std::vector<std::vector<float>> full;
  for (const Weight& w : Weights()) {
    std::vector<float> p(w.rows * w.cols), m(p.size(), 0.0f), s(p.size()),
        gr(p.size());
    for (int64_t i = 0; i < w.rows; ++i)
      for (int64_t j = 0; j < w.cols; ++j)
        p[i * w.cols + j] = Value(w.name, 0, i, j);
    auto view = [&](std::vector<float>& v) {
      return ContiguousView(v.data(), DType::kFloat32, w.rows, w.cols);
    };
    auto ns = NewtonSchulz::Create(backend.get(), muon->ns, w.rows, w.cols, 1);
    for (int step : grad_steps) {
      for (int64_t i = 0; i < w.rows; ++i)
        for (int64_t j = 0; j < w.cols; ++j)
          gr[i * w.cols + j] = Value(w.name + "/grad", step, i, j);
      (void)MuonStepFullMatrix(*backend, *muon, **ns, view(p), view(gr),
                               view(m), view(s));
    }
    full.push_back(std::move(p));
  }
  std::vector<float> out;
  for (int rank = 0; rank < kWorld; ++rank) {
    for (size_t k = 0; k < Weights().size(); ++k) {
      const Weight& w = Weights()[k];
      const Shard& sh = buffers_[rank][k].shard;
      for (int64_t i = 0; i < sh.real; ++i)
        for (int64_t j = 0; j < sh.nc; ++j)
          out.push_back(full[k][(sh.r0 + i) * w.cols + sh.c0 + j]);
    }
  }
  return out;
}

}  // namespace muond::reliability
