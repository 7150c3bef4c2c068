// A trainer process of the multi-process system test (system_test.cc): it
// owns full copies of a few weights in shared memory, registers its (g, t)
// shard of each with its daemon (column blocks as strided views into the full
// matrix, padded GTP shards as separate buffers), runs 3 steps and compares
// its shards bitwise with the single-process reference (MuonStepFullMatrix
// on the same CPU backend). It also checks that nothing outside its shards
// changed, the step-id replay rule, and (rank 0 with --rebalance) that a
// Rebalance with another cost table changes homes and activates at step 2.
// With --precision=medium the group runs bf16 Newton–Schulz (NsWorkDType) and
// the reference does too, so the comparison stays bitwise. With
// --second_precision two weights go to a second group of that precision on
// the same domain (same communicators, so the same lane in the daemon).
// With --device=N the shards live on CUDA device N (copies of the shm
// buffers, registered by CUDA IPC; the daemon runs on the same GPU) and the
// reference runs on the CUDA backend, so the comparison stays bitwise: the
// multi-GPU full system (system_cuda_test).
// Exit 0 = all checks passed; messages on stderr otherwise.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/client.h"
#include "client/cpp/shm_region.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/backend/openblas_core.h"
#include "core/common/status_macros.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "server/common/proto_convert_options.h"
#include "server/daemon/engine_factory.h"
#include "tests/common/muon_group.h"
#include "tests/common/shard_geometry.h"

ABSL_FLAG(std::string, daemon, "", "daemon address");
ABSL_FLAG(std::string, coordinator, "", "coordinator host:port");
ABSL_FLAG(std::string, job, "sys", "job id");
ABSL_FLAG(int, rank, 0, "rank = g * 2 + t in the 2x2 domain");
ABSL_FLAG(bool, rebalance, false, "issue a Rebalance before step 1");
ABSL_FLAG(int, steps, 3, "steps");
ABSL_FLAG(bool, expect_rebalance, false,
          "a Rebalance activating at step 2 is issued by rank 0");
ABSL_FLAG(std::string, precision, "highest",
          "fp32_matmul_prec of the group (medium: bf16 NS input, exchanges "
          "and output on the daemons and in the reference)");
ABSL_FLAG(int, device, -1,
          "CUDA device of the shards (-1: host shared memory, the default)");
ABSL_FLAG(std::string, second_precision, "",
          "when set, 'row' and 'big' go to a second Muon group 'muon2' of this "
          "fp32_matmul_prec on the same domain (one lane: both groups share "
          "the daemon's exchange buffers, in different dtypes)");

namespace muond {
namespace {

constexpr int G = 2, T = 2;

using testing::Shard;
using testing::Weight;

const std::vector<Weight> kWeights = {
    {"col", 32, 16, 0, true, 0},  {"row", 16, 32, 1, true, 0},
    {"gtp", 24, 16, -1, true, 0}, {"pad", 36, 8, 0, true, 2},
    {"rep", 8, 8, -1, false, 0},  {"big", 64, 32, 0, true, 0},
    {"wide", 16, 64, 1, true, 0},
};

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

v1::ShardTags TagsOf(const Weight& w) {
  v1::ShardTags tags;
  tags.set_tensor_model_parallel(w.tp_dim >= 0);
  tags.set_partition_dim(w.tp_dim >= 0 ? w.tp_dim : 0);
  tags.set_is_gtp_weight_remat(w.gtp);
  tags.set_pad_length(w.pad);
  return tags;
}

// Which registered group weight `w` belongs to: 0 ("muon"), or 1 ("muon2")
// with --second_precision.
int GroupOf(const Weight& w) {
  const bool second = !absl::GetFlag(FLAGS_second_precision).empty() &&
                      (w.name == "row" || w.name == "big");
  return second ? 1 : 0;
}

// Group `index` as this trainer registers it, before params are added; the
// reference takes its options from the same message.
v1::ParamGroup TrainerGroup(int index, int g, int t) {
  v1::ParamGroup group = muond::testing::DenseMuonGroup(G, T, g, t);
  if (index == 1) group.set_name("muon2");
  const std::string precision =
      absl::GetFlag(index == 0 ? FLAGS_precision : FLAGS_second_precision);
  if (!precision.empty()) {
    absl::StatusOr<MatmulPrecision> parsed = ParseMatmulPrecision(precision);
    if (!parsed.ok()) {
      std::fprintf(stderr, "system_trainer: %s\n",
                   std::string(parsed.status().message()).c_str());
      std::exit(2);
    }
    group.mutable_muon()->set_fp32_matmul_prec(ToProto(*parsed));
  }
  return group;
}

bool rebalance_all() {
  return absl::GetFlag(FLAGS_rebalance) ||
         absl::GetFlag(FLAGS_expect_rebalance);
}

int Fail(const std::string& msg) {
  fprintf(stderr, "trainer %d: FAIL: %s\n", absl::GetFlag(FLAGS_rank),
          msg.c_str());
  return 1;
}

int Run() {
  const int rank = absl::GetFlag(FLAGS_rank);
  const int g = rank / T, t = rank % T;
  const int steps = absl::GetFlag(FLAGS_steps);
  const bool rebalance = absl::GetFlag(FLAGS_rebalance);

  // Shared memory: full param + grad per weight, plus a local buffer pair for
  // padded shards.
  size_t bytes = 0;
  for (const Weight& w : kWeights)
    bytes += 4 * (w.rows * w.cols * 2 + 64) + 4096;
  auto region = ShmRegion::Create(
      absl::StrCat("/muond-sys-", getpid(), "-r", rank), bytes);
  if (!region.ok()) return Fail(region.status().ToString());
  struct Buffers {
    float* full_param;
    float* full_grad;
    float* local_param = nullptr;  // padded shards only
    float* local_grad = nullptr;
    Shard shard;
    // --device: device copies of the host buffers the daemon sees (the
    // local pair for padded shards, else the full pair).
    void* dev_param = nullptr;
    void* dev_grad = nullptr;
    int64_t dev_bytes = 0;
    // The CUDA IPC regions of dev_param / dev_grad.
    CudaAllocation dev_param_region, dev_grad_region;
    float* host_param() const { return local_param ? local_param : full_param; }
    float* host_grad() const { return local_grad ? local_grad : full_grad; }
  };
  const int device = absl::GetFlag(FLAGS_device);
  std::unique_ptr<Backend> cuda;
  if (device >= 0) {
    auto made = MakeCudaBackend(device);
    if (!made.ok()) return Fail(made.status().ToString());
    cuda = *std::move(made);
  }
  // The daemon's view of a host buffer: the buffer itself (shm), or its
  // device copy at the same offset.
  auto ref =
      [&](const Buffers& b, bool param, float* at, std::vector<int64_t> shape,
          std::vector<int64_t> strides = {}) -> absl::StatusOr<v1::TensorRef> {
    if (cuda == nullptr) {
      return HostRef(**region, at, v1::DTYPE_FP32, std::move(shape),
                     std::move(strides));
    }
    float* host = param ? b.host_param() : b.host_grad();
    char* dev = static_cast<char*>(param ? b.dev_param : b.dev_grad);
    return CudaRef(param ? b.dev_param_region : b.dev_grad_region,
                   dev + (at - host) * 4, v1::DTYPE_FP32, std::move(shape),
                   std::move(strides));
  };
  // The regions the refs lie in: the shm object, or every device buffer.
  std::vector<v1::MemoryRegion> regions;
  if (cuda == nullptr) regions.push_back(HostRegion(**region));
  auto push = [&](const Buffers& b, bool param) -> absl::Status {
    if (cuda == nullptr) return absl::OkStatus();
    RETURN_IF_ERROR(cuda->CopyFromHost(param ? b.dev_param : b.dev_grad,
                                       param ? b.host_param() : b.host_grad(),
                                       b.dev_bytes));
    return cuda->Synchronize();
  };
  auto pull_params = [&](std::vector<Buffers>& all) -> absl::Status {
    if (cuda == nullptr) return absl::OkStatus();
    for (Buffers& b : all) {
      RETURN_IF_ERROR(
          cuda->CopyToHost(b.host_param(), b.dev_param, b.dev_bytes));
    }
    return absl::OkStatus();
  };
  std::vector<Buffers> buffers;
  std::vector<v1::ParamGroup> groups = {TrainerGroup(0, g, t)};
  if (!absl::GetFlag(FLAGS_second_precision).empty()) {
    groups.push_back(TrainerGroup(1, g, t));
  }
  for (const Weight& w : kWeights) {
    Buffers b;
    b.full_param =
        static_cast<float*>(*(*region)->Allocate(4 * w.rows * w.cols));
    b.full_grad =
        static_cast<float*>(*(*region)->Allocate(4 * w.rows * w.cols));
    b.shard = testing::ShardOf(w, G, T, g, t);
    for (int64_t i = 0; i < w.rows; ++i) {
      for (int64_t j = 0; j < w.cols; ++j) {
        b.full_param[i * w.cols + j] = Value(w.name, 0, i, j);
      }
    }
    absl::StatusOr<v1::TensorRef> pref, gref;
    if (w.pad > 0) {
      const size_t n = 4 * b.shard.nr * b.shard.nc;
      b.local_param = static_cast<float*>(*(*region)->Allocate(n));
      b.local_grad = static_cast<float*>(*(*region)->Allocate(n));
      for (int64_t i = 0; i < b.shard.real; ++i) {
        memcpy(b.local_param + i * b.shard.nc,
               b.full_param + (b.shard.r0 + i) * w.cols + b.shard.c0,
               4 * b.shard.nc);
      }
    }
    if (cuda != nullptr) {
      b.dev_bytes =
          b.local_param ? 4 * b.shard.nr * b.shard.nc : 4 * w.rows * w.cols;
      auto p = cuda->Allocate(b.dev_bytes);
      auto gr = cuda->Allocate(b.dev_bytes);
      if (!p.ok() || !gr.ok()) return Fail("cannot allocate device memory");
      b.dev_param = *p;
      b.dev_grad = *gr;
      if (!push(b, true).ok()) return Fail("cannot copy params to the device");
      auto pr = CudaRegion(b.dev_param, w.name + ".param");
      auto gr_region = CudaRegion(b.dev_grad, w.name + ".grad");
      if (!pr.ok() || !gr_region.ok()) {
        return Fail("CudaRegion: " +
                    (pr.ok() ? gr_region.status() : pr.status()).ToString());
      }
      b.dev_param_region = *std::move(pr);
      b.dev_grad_region = *std::move(gr_region);
      regions.push_back(b.dev_param_region.region);
      regions.push_back(b.dev_grad_region.region);
    }
    if (w.pad > 0) {
      pref = ref(b, true, b.local_param, {b.shard.nr, b.shard.nc});
      gref = ref(b, false, b.local_grad, {b.shard.nr, b.shard.nc});
    } else {
      const int64_t off = b.shard.r0 * w.cols + b.shard.c0;
      pref = ref(b, true, b.full_param + off, {b.shard.nr, b.shard.nc},
                 {w.cols, 1});
      gref = ref(b, false, b.full_grad + off, {b.shard.nr, b.shard.nc},
                 {w.cols, 1});
    }
    if (!pref.ok() || !gref.ok()) {
      return Fail("TensorRef: " +
                  (pref.ok() ? gref.status() : pref.status()).ToString());
    }
    *groups[GroupOf(w)].add_params() =
        MakeParam(w.name, {w.rows, w.cols}, *pref, *gref, TagsOf(w));
    buffers.push_back(b);
  }

  ClientOptions options;
  options.job_id = absl::GetFlag(FLAGS_job);
  options.rpc_timeout = absl::Seconds(30);
  auto client = Client::Connect(absl::GetFlag(FLAGS_daemon), options);
  if (!client.ok()) return Fail(client.status().ToString());
  auto registered = (*client)->Register(regions, groups);
  if (!registered.ok())
    return Fail("Register: " + registered.status().ToString());
  if (absl::Status st = (*client)->WaitForPlan(absl::Seconds(30)); !st.ok()) {
    return Fail(st.ToString());
  }

  if (rebalance) {
    auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(
        absl::GetFlag(FLAGS_coordinator), grpc::InsecureChannelCredentials()));
    v1::GetPlanRequest get;
    get.set_job_id(options.job_id);
    v1::Plan first;
    {
      grpc::ClientContext ctx;
      if (!stub->GetPlan(&ctx, get, &first).ok()) return Fail("GetPlan");
    }
    v1::RebalanceRequest req;
    req.set_job_id(options.job_id);
    req.set_activate_after_steps(2);
    // Costs that invert the analytic order: small matrices expensive.
    for (const Weight& w : kWeights) {
      v1::ShapeTiming* c = req.add_cost_table();
      c->add_shape(w.rows);
      c->add_shape(w.cols);
      c->set_ns_us(1e6 / double(w.rows * w.cols));
    }
    v1::Plan second;
    grpc::ClientContext ctx;
    grpc::Status st = stub->Rebalance(&ctx, req, &second);
    if (!st.ok()) return Fail("Rebalance: " + st.error_message());
    if (second.version() != first.version() + 1 ||
        second.activate_at_step() != 2) {
      return Fail(absl::StrCat("Rebalance gave version ", second.version(),
                               " activating at ", second.activate_at_step()));
    }
    bool changed = false;
    for (int k = 0; k < first.groups_size(); ++k) {
      for (int i = 0; i < first.groups(k).homes_size(); ++i) {
        changed |=
            first.groups(k).homes(i).g() != second.groups(k).homes(i).g() ||
            first.groups(k).homes(i).t() != second.groups(k).homes(i).t();
      }
    }
    if (!changed) return Fail("the rebalanced plan has the same homes");
    fprintf(stderr, "trainer 0: plan v%ld -> v%ld (activates at step %ld)\n",
            long(first.version()), long(second.version()),
            long(second.activate_at_step()));
  }

  for (int step = 1; step <= steps; ++step) {
    for (size_t k = 0; k < kWeights.size(); ++k) {
      const Weight& w = kWeights[k];
      Buffers& b = buffers[k];
      for (int64_t i = 0; i < w.rows; ++i) {
        for (int64_t j = 0; j < w.cols; ++j) {
          b.full_grad[i * w.cols + j] = Value(w.name + "/grad", step, i, j);
        }
      }
      if (b.local_grad != nullptr) {
        memset(b.local_grad, 0, 4 * b.shard.nr * b.shard.nc);
        for (int64_t i = 0; i < b.shard.real; ++i) {
          memcpy(b.local_grad + i * b.shard.nc,
                 b.full_grad + (b.shard.r0 + i) * w.cols + b.shard.c0,
                 4 * b.shard.nc);
        }
      }
      if (!push(b, false).ok()) return Fail("cannot copy grads to the device");
    }
    const int64_t expected_version = (rebalance_all() && step >= 2) ? 2 : 1;
    if (expected_version == 2) {
      // Plan v2 must have reached our daemon before its activation step.
      for (int i = 0; i < 2000; ++i) {
        auto s = (*client)->Status();
        if (s.ok() && s->latest_plan_version() >= 2) break;
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    auto r = (*client)->Step(step);
    if (!r.ok())
      return Fail(absl::StrCat("Step ", step, ": ", r.status().ToString()));
    if (r->plan_version() != expected_version) {
      return Fail(absl::StrCat("step ", step, " ran with plan v",
                               r->plan_version(), ", expected v",
                               expected_version));
    }
  }
  // Replays change nothing; going back is refused.
  if (!pull_params(buffers).ok()) return Fail("cannot copy params back");
  std::vector<float> before(buffers[0].full_param,
                            buffers[0].full_param + 32 * 16);
  auto replay = (*client)->Step(steps);
  if (!replay.ok() || !replay->replayed()) return Fail("replay not recorded");
  if (!pull_params(buffers).ok()) return Fail("cannot copy params back");
  if (memcmp(before.data(), buffers[0].full_param, before.size() * 4) != 0) {
    return Fail("replay changed params");
  }
  auto back = (*client)->Step(1);
  if (back.ok() ||
      back.status().code() != absl::StatusCode::kFailedPrecondition) {
    return Fail("step id going back was not refused");
  }

  // The single-process reference, on the backend the daemons step on.
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  Backend* backend = cuda ? cuda.get() : cpu.get();
  int mismatches = 0;
  for (size_t k = 0; k < kWeights.size(); ++k) {
    const Weight& w = kWeights[k];
    const Buffers& b = buffers[k];
    absl::StatusOr<MuonOptions> muon =
        MuonOptionsFromProto(TrainerGroup(GroupOf(w), g, t));
    if (!muon.ok()) return Fail(muon.status().ToString());
    std::vector<float> p(w.rows * w.cols), m(p.size(), 0.0f), gr(p.size());
    for (int64_t i = 0; i < w.rows; ++i)
      for (int64_t j = 0; j < w.cols; ++j)
        p[i * w.cols + j] = Value(w.name, 0, i, j);
    // Param, grad, momentum and the NS scratch (in the daemon's work dtype,
    // bf16 for medium; room for fp32) in the backend's memory.
    const int64_t bytes = 4 * w.rows * w.cols;
    void* mem[4];
    for (void*& ptr : mem) {
      auto a = backend->Allocate(bytes);
      if (!a.ok()) return Fail(a.status().ToString());
      ptr = *a;
    }
    auto view = [&](void* ptr, DType dtype = DType::kFloat32) {
      return ContiguousView(ptr, dtype, w.rows, w.cols);
    };
    if (!backend->CopyFromHost(mem[0], p.data(), bytes).ok() ||
        !backend->CopyFromHost(mem[2], m.data(), bytes).ok()) {
      return Fail("reference: cannot copy to the backend");
    }
    auto ns = NewtonSchulz::Create(backend, muon->ns, w.rows, w.cols, 1);
    if (!ns.ok()) return Fail(ns.status().ToString());
    for (int step = 1; step <= steps; ++step) {
      for (int64_t i = 0; i < w.rows; ++i)
        for (int64_t j = 0; j < w.cols; ++j)
          gr[i * w.cols + j] = Value(w.name + "/grad", step, i, j);
      if (!backend->CopyFromHost(mem[1], gr.data(), bytes).ok()) {
        return Fail("reference: cannot copy grads to the backend");
      }
      absl::Status st = MuonStepFullMatrix(
          *backend, *muon, **ns, view(mem[0]), view(mem[1]), view(mem[2]),
          view(mem[3], NsWorkDType(muon->ns.precision)));
      if (!st.ok()) return Fail(st.ToString());
    }
    if (!backend->CopyToHost(p.data(), mem[0], bytes).ok()) {
      return Fail("reference: cannot copy params back");
    }
    for (void* ptr : mem) backend->Free(ptr);
    const Shard& sh = b.shard;
    for (int64_t i = 0; i < w.rows; ++i) {
      for (int64_t j = 0; j < w.cols; ++j) {
        const bool mine = i >= sh.r0 && i < sh.r0 + sh.real && j >= sh.c0 &&
                          j < sh.c0 + sh.nc;
        float got = b.full_param[i * w.cols + j];
        if (mine && b.local_param != nullptr) {
          got = b.local_param[(i - sh.r0) * sh.nc + (j - sh.c0)];
        }
        const float want = mine ? p[i * w.cols + j] : Value(w.name, 0, i, j);
        if (memcmp(&got, &want, 4) != 0 && mismatches++ < 5) {
          fprintf(stderr, "trainer %d: %s[%ld,%ld] (%s) = %.9g, want %.9g\n",
                  rank, w.name.c_str(), long(i), long(j),
                  mine ? "shard" : "outside shard", got, want);
        }
      }
    }
  }
  if (mismatches > 0)
    return Fail(absl::StrCat(mismatches, " mismatching elements"));
  if (absl::Status st = (*client)->Unregister(); !st.ok()) {
    return Fail(absl::StrCat("unregister: ", st.message()));
  }
  fprintf(stderr, "trainer %d: %d steps (%s) bitwise equal to the reference\n",
          rank, steps, absl::GetFlag(FLAGS_precision).c_str());
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) {
  // The daemons pick these kernels too: the reference stays bitwise theirs.
  muond::ReexecWithBetterOpenBlasCore(argv);
  absl::ParseCommandLine(argc, argv);
  return muond::Run();
}
