#pragma once
// Multi-process harness of the reliability tests: real muond-coordinator and
// muond binaries (host mode, Gloo, 2x2 domain) and four in-process trainers
// (muond::Client over shared memory) that step concurrently, one thread per
// rank. The weights, their shards and the single-process reference follow
// tests/server/daemon/system_trainer.cc.
#include <signal.h>
#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/cpp/client.h"
#include "client/cpp/shm_region.h"
#include "muond/v1/muond.grpc.pb.h"
#include "tests/common/shard_geometry.h"
#include "tests/common/spawn.h"

namespace muond::reliability {

// Runfile(path) and Spawn(args, log) (stdout+stderr appended to `log` when
// given; -1 on failure): tests/common/spawn.h.
using ::muond::testing::Runfile;
using ::muond::testing::Spawn;
// Exit code, 128 + signal, or -1 after `timeout` (then SIGKILLed).
int WaitExit(pid_t pid, absl::Duration timeout);
bool WaitForFile(const std::string& path, absl::Duration timeout);
// Runs `args` to completion; returns the exit code and fills `output`.
int RunTool(const std::vector<std::string>& args, std::string* output,
            absl::Duration timeout = absl::Seconds(20));

constexpr int kG = 2, kT = 2, kWorld = kG * kT;

// A coordinator and kWorld daemons in a private 0700 directory.
class Cluster {
 public:
  struct Options {
    std::vector<std::string> daemon_flags;  // extra muond flags
    std::string token;                      // --token on every server
    // With `token`: pass it as --token_file (a 0600 file in dir()) instead.
    bool token_in_file = false;
  };
  explicit Cluster(Options options);
  ~Cluster();  // SIGKILLs whatever is still running, removes the directory

  void StartCoordinator(int port = 0);  // 0: pick one (then fixed)
  void KillCoordinator(int sig = SIGKILL);
  // Sends `sig` and returns the exit code (WaitExit: -1 when it is still
  // running after `bound`, then SIGKILLed).
  int StopCoordinator(int sig, absl::Duration bound);
  void StartDaemon(int rank);
  void KillDaemon(int rank, int sig = SIGKILL);
  bool DaemonAlive(int rank);
  pid_t daemon_pid(int rank) const { return daemons_[rank]; }
  pid_t coordinator_pid() const { return coordinator_pid_; }
  void StartAll();

  // ListDaemons until every rank is live (or none is, when `live` is false).
  bool WaitDaemonsLive(bool live, absl::Duration timeout);
  std::unique_ptr<v1::Coordinator::Stub> CoordinatorStub() const;
  void AddToken(grpc::ClientContext* context) const;

  const std::string& dir() const { return dir_; }
  const std::string& job() const { return job_; }
  std::string coordinator() const;
  std::string socket(int rank) const;
  const Options& options() const { return options_; }

  // A trainer's client of rank `rank`'s daemon (client_id "trainer<rank>",
  // 30 s RPC deadline), over its Unix socket.
  absl::StatusOr<std::unique_ptr<Client>> ConnectTrainer(int rank) const;
  // Every server's log (the last `tail_lines` lines of each; 0: whole), for a
  // failure message: the test directory is removed at the end.
  std::string ServerLogs(int tail_lines = 0) const;

 private:
  void AddTokenFlag(std::vector<std::string>& args) const;

  Options options_;
  std::string dir_, job_;
  int port_ = 0;
  int incarnation_ = 0;
  pid_t coordinator_pid_ = -1;
  std::vector<pid_t> daemons_;
};

// The weights of the 2x2 test: (rows, cols, tp_dim -1/0/1, gtp, pad).
using testing::Weight;
const std::vector<Weight>& Weights();

// Deterministic values in [-1, 1]: params at step 0, grads at step >= 1.
float Value(const std::string& name, int step, int64_t i, int64_t j);

// The four trainers (one per rank), in this process.
class Trainers {
 public:
  explicit Trainers(const Cluster& cluster, const std::string& tag = "t");
  ~Trainers();

  // Connects and registers every rank, then waits for the plans.
  absl::Status RegisterAll(absl::Duration timeout = absl::Seconds(30));
  // Writes the gradients of `grad_step` (Value(name + "/grad", grad_step))
  // into every rank's shards; `poison` puts NaN at one element of that param.
  void FillGrads(int grad_step, const std::string& poison = "");
  // Step `id` on every rank concurrently.
  std::vector<absl::StatusOr<v1::StepResponse>> StepAll(int64_t id);
  // FillGrads(id) + StepAll(id), failing on the first error.
  absl::Status RunSteps(int64_t first, int64_t last);

  // Every rank's shard of every weight, in order (rank-major).
  std::vector<float> Shards() const;
  // The same from the single-process reference after grads of steps
  // `grad_steps` (in order) were applied to the step-0 params.
  std::vector<float> ReferenceShards(const std::vector<int>& grad_steps) const;

  Client& client(int rank) { return *clients_[rank]; }
  v1::ParamGroup Group(int rank) const;  // the registered group of `rank`
  // The one memory region every ref of Group(rank) lies in.
  v1::MemoryRegion Region(int rank) const;

 private:
  using Shard = testing::Shard;
  struct Buffers {
    float* full_param;
    float* full_grad;
    float* local_param = nullptr;  // padded shards
    float* local_grad = nullptr;
    Shard shard;
  };
  const Cluster& cluster_;
  std::vector<std::unique_ptr<ShmRegion>> regions_;  // [rank]
  std::vector<std::vector<Buffers>> buffers_;        // [rank][weight]
  std::vector<v1::ParamGroup> groups_;
  std::vector<std::unique_ptr<Client>> clients_;
};

// Hyperparameters of the test group (Muon, Nesterov, decoupled wd).
v1::ParamGroup BaseGroup(int g, int t);

}  // namespace muond::reliability
