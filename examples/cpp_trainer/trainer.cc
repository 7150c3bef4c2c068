// A C++ trainer of muond in one file: it fits K matrices W_k to targets T_k
// (loss 0.5 |W - T|^2, gradient W - T) with Muon run by a host-mode daemon.
// What a trainer in any language does:
//   1. put its params and grads in memory the daemon can map (a host shm
//      region here; CudaRegion/CudaRef for device memory),
//   2. Register one group per set of hyperparameters (algorithm, domain),
//   3. per step: write the grads, call Step(step_id), read the new params;
//   4. Unregister at the end.
//
//   bazel build //examples/cpp_trainer:trainer
//   bazel-bin/examples/cpp_trainer/trainer --job_id=demo --steps=50
//       --address=unix:///tmp/muond-demo-0.sock
// (the coordinator and a host daemon started as README.md's "Run your own
// training script" says). It prints the loss every 10 steps and whether its
// steps go through the step channel, and exits non-zero on any error.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/cpp/client.h"
#include "client/cpp/shm_region.h"

ABSL_FLAG(std::string, address, "",
          "the daemon's address (unix:///... or host:port)");
ABSL_FLAG(std::string, job_id, "demo",
          "the job id the daemon was started with");
ABSL_FLAG(int, steps, 50, "optimizer steps");
ABSL_FLAG(int, matrices, 3, "matrices to fit");
ABSL_FLAG(bool, step_channel, true,
          "steps through the step channel (else the Step RPC)");

namespace {

constexpr int64_t kRows = 32, kCols = 64;
constexpr int64_t kElems = kRows * kCols;

struct Matrix {
  float* param;
  float* grad;
  std::vector<float> target;
};

// One Muon group of every matrix, on a domain with no tensor parallelism.
muond::v1::ParamGroup MuonGroup() {
  muond::v1::ParamGroup group;
  group.set_name("matrices");
  group.set_algorithm(muond::v1::ALGORITHM_MUON);
  muond::v1::MuonHyperparams* h = group.mutable_muon();
  h->set_lr(0.02);
  h->set_momentum(0.95);
  h->set_nesterov(true);
  h->set_weight_decay(0.0);
  muond::v1::Domain* domain = group.mutable_domain();
  domain->set_name("dense");
  domain->set_gtp_size(1);
  domain->set_tp_size(1);
  return group;
}

double LossAndGrad(const std::vector<Matrix>& matrices) {
  double loss = 0;
  for (const Matrix& m : matrices) {
    for (int64_t i = 0; i < kElems; ++i) {
      const float d = m.param[i] - m.target[i];
      m.grad[i] = d;
      loss += 0.5 * double(d) * d;
    }
  }
  return loss;
}

absl::Status Train() {
  const int count = absl::GetFlag(FLAGS_matrices);
  const size_t bytes = kElems * sizeof(float);
  absl::StatusOr<std::unique_ptr<muond::ShmRegion>> region =
      muond::ShmRegion::Create(absl::StrCat("/muond-example-", getpid()),
                               count * 2 * (bytes + 256));
  if (!region.ok()) return region.status();
  muond::v1::ParamGroup group = MuonGroup();
  std::vector<Matrix> matrices(count);
  for (int k = 0; k < count; ++k) {
    Matrix& m = matrices[k];
    m.param = static_cast<float*>(*(*region)->Allocate(bytes, 256));
    m.grad = static_cast<float*>(*(*region)->Allocate(bytes, 256));
    m.target.resize(kElems);
    for (int64_t i = 0; i < kElems; ++i) {
      m.param[i] = 0;
      m.target[i] = float((i * 7 + k * 13) % 17 - 8) / 64;
    }
    const auto ref = [&](float* data) {
      return *muond::HostRef(**region, data, muond::v1::DTYPE_FP32,
                             {kRows, kCols});
    };
    *group.add_params() = muond::MakeParam(absl::StrCat("w", k), {kRows, kCols},
                                           ref(m.param), ref(m.grad));
  }

  muond::ClientOptions options;
  options.job_id = absl::GetFlag(FLAGS_job_id);
  options.step_channel = absl::GetFlag(FLAGS_step_channel);
  absl::StatusOr<std::unique_ptr<muond::Client>> client =
      muond::Client::Connect(absl::GetFlag(FLAGS_address), options);
  if (!client.ok()) return client.status();
  absl::Status status =
      (*client)->Register({muond::HostRegion(**region)}, {group}).status();
  if (!status.ok()) return status;
  status = (*client)->WaitForPlan(absl::Seconds(60));
  if (!status.ok()) return status;
  std::printf("step channel: %s\n",
              (*client)->HasStepChannel()
                  ? "yes"
                  : (*client)->StepChannelStatus().ToString().c_str());

  const int steps = absl::GetFlag(FLAGS_steps);
  for (int step = 1; step <= steps; ++step) {
    const double loss = LossAndGrad(matrices);  // forward and backward
    if (step == 1 || step % 10 == 0)
      std::printf("step %d loss %.6f\n", step, loss);
    absl::StatusOr<muond::v1::StepResponse> applied = (*client)->Step(step);
    if (!applied.ok()) return applied.status();
  }
  std::printf("final loss %.6f\n", LossAndGrad(matrices));
  // The daemon keeps a trainer's params until it unregisters (another
  // trainer of the job registers only then).
  return (*client)->Unregister();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_address).empty()) {
    std::fprintf(stderr, "trainer: --address is required (the daemon's)\n");
    return 2;
  }
  const absl::Status status = Train();
  if (!status.ok()) {
    std::fprintf(stderr, "trainer: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
