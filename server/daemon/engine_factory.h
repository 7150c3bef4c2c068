#pragma once
// The real step engine: a compute backend, Gloo (host) or NCCL (device)
// communicators per domain through the coordinator's store, and
// LayerShardedMuon over the registration's views.
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "core/backend/cuda_backend_options.h"
#include "core/comm/kv_store.h"
#include "core/muon/adamw.h"
#include "core/muon/muon_update.h"
#include "server/common/proto_convert_options.h"  // MuonOptionsFromProto
#include "server/daemon/daemon_core.h"

namespace muond {

struct EngineOptions {
  std::string job_id;
  // This daemon's rank in the job and the job's size: the job communicator
  // (every daemon, Gloo in host and GPU mode) carries each step's vote
  // (core/step/job_vote.h). world_size 1: no job communicator.
  int rank = 0;
  int world_size = 1;
  int device = -1;  // -1: host mode (CPU backend, Gloo)
  // The switches of every CUDA backend the engine makes (muond-daemon
  // --cublas_gemmex, --cuda_graphs, --lt_autotune); unused in host mode.
  CudaBackendOptions cuda;
  std::string gloo_hostname = "127.0.0.1";
  absl::Duration comm_timeout = absl::Seconds(60);
  // Skip (instead of fail) steps with non-finite gradients (muond
  // --skip_nonfinite); params and momentum stay unchanged either way.
  bool skip_nonfinite = false;
  // StepOptions::testonly_commit_delay_ms (tests of a peer dying mid-step).
  int testonly_commit_delay_ms = 0;
  // StepOptions::max_ns_workspace_bytes (--max_ns_workspace_bytes).
  int64_t max_ns_workspace_bytes = 0;
  // Counts the domain communicators' exchange bytes (shared: an abandoned
  // build may outlive the daemon core); null: not counted.
  std::shared_ptr<DaemonMetrics> metrics;
};

// RegisterParams's check of a group for a daemon on CUDA device `device` (-1:
// host mode): its hyperparameters (MuonOptionsFromProto /
// AdamWOptionsFromProto) and, for Muon, the NS precision against the backend
// the daemon steps on (host mode has highest and medium; TF32 "high" is CUDA
// only). InvalidArgument naming the group, at registration, instead of a
// step engine that later fails to build and a trainer left waiting.
absl::Status ValidateGroupForDevice(const v1::ParamGroup& group, int device);

// The factory and every build it runs share `store` (the rendezvous store),
// so an abandoned build may outlive its daemon core (engine_builder.h).
EngineFactory MakeEngineFactory(EngineOptions options,
                                std::shared_ptr<KeyValueStore> store);

}  // namespace muond
