// Scaling benchmark of the layer-sharded step: the optimizer step
// of a matrix set on N ranks, one process per rank (a GPU each with
// --device=cuda and NCCL, or a host rank with Gloo for the CPU equivalent),
// in an N x 1 domain: every matrix is GTP-sharded by rows over the N ranks.
// For each N of --ranks, measured side by side in one run:
//
//   sharded     the daemon's step engine (LayerShardedMuon, LPT NS homes):
//               momentum -> all_to_allv to each matrix's NS home -> NS ->
//               all_to_allv back -> update;
//   duplicated  Megatron's tp_mode="duplicated": every rank all-gathers every
//               momentum matrix and runs Newton–Schulz on all of them;
//   raw a2a     one all_to_allv over the same communicator moving the same
//               total bytes as the sharded forward exchange, split evenly
//               over the rank pairs: the exchange's ceiling on this fabric.
//
// Each rank runs sharded, then duplicated from the same initial params and
// grads, and reports the largest difference between the two results (0 =
// bitwise equal, as they are at ns_batch_size 1). The summary gives the
// per-phase medians over steps (mean over ranks), the slowest rank's NS time
// over the mean, the exchange's achieved bytes/s against the raw a2a, and the
// NS speedup against the smallest N of the run. Timings are the step
// engine's phase timings (on a device, GPU time between events around each
// phase; on the host, wall time).
//
//   scaling_bench --shapes=4096x4096*4,14336x4096*8,... --ranks=1,2,4,8
//                 [--device=cuda|cpu] [--precision=medium|highest|high]
//                 [--steps=10] [--warmup=2]
//
// Shapes are RxC, RxC*K repeats it K times; R must be divisible by every N
// (no GTP padding, so the duplicated path keeps contiguous row slices).
// Exit 0 when every rank succeeded and the two paths agreed (max |diff| 0 at
// highest precision; reported, not checked, otherwise).
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/common/torch_muon_defaults.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/backend/openblas_core.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/comm/nccl_communicator.h"
#include "core/common/status_macros.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/plan/planner.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {
namespace {

struct Options {
  std::vector<std::pair<int64_t, int64_t>> shapes;
  std::vector<int> ranks;
  bool cuda = true;
  std::string precision = "medium";
  int steps = 10;
  int warmup = 2;
};

// Per-rank medians over the measured steps, microseconds.
struct RankResult {
  PhaseTimings sharded, duplicated;
  double raw_a2a_us = 0;
  double exchange_bytes = 0;  // the sharded forward exchange, all ranks
  double max_abs_diff = 0;    // sharded vs duplicated params
};

// A deterministic value of element (row, col) of matrix `m` (what = 0:
// param, 1: grad), independent of how the matrix is sharded.
float Value(int m, int what, int64_t row, int64_t col) {
  uint64_t h = (uint64_t(m) * 1000003 + uint64_t(what)) * 0x9E3779B97F4A7C15ull;
  h ^= uint64_t(row) * 0xC2B2AE3D27D4EB4Full + uint64_t(col);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  const float unit = float(int32_t(h & 0xFFFFFF) - (1 << 23)) / float(1 << 23);
  return what == 0 ? 0.02f * unit : 1e-3f * unit;
}

// This rank's row block of every matrix, fp32 on the backend.
struct Shard {
  int64_t rows, cols, full_rows;
  void *param = nullptr, *grad = nullptr;
};

absl::Status Fill(Backend& b, const Shard& s, int m, int64_t row0) {
  std::vector<float> host(s.rows * s.cols);
  for (int what = 0; what < 2; ++what) {
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        host[i * s.cols + j] = Value(m, what, row0 + i, j);
      }
    }
    RETURN_IF_ERROR(b.CopyFromHost(what == 0 ? s.param : s.grad, host.data(),
                                   host.size() * 4));
  }
  return b.Synchronize();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

PhaseTimings MedianTimings(const std::vector<PhaseTimings>& steps) {
  PhaseTimings out;
  for (double PhaseTimings::*f :
       {&PhaseTimings::momentum_us, &PhaseTimings::a2a_fwd_us,
        &PhaseTimings::ns_us, &PhaseTimings::a2a_bwd_us,
        &PhaseTimings::update_us, &PhaseTimings::total_us}) {
    std::vector<double> v;
    for (const PhaseTimings& t : steps) v.push_back(t.*f);
    out.*f = Median(v);
  }
  return out;
}

class Rank {
 public:
  Rank(const Options& o, int rank, int world, const std::string& dir)
      : o_(o), rank_(rank), world_(world), dir_(dir), store_(dir + "/store") {}

  absl::StatusOr<RankResult> Run() {
    if (o_.cuda) {
      ASSIGN_OR_RETURN(backend_, MakeCudaBackend(rank_));
    } else {
      backend_ = MakeCpuBackend();
    }
    ASSIGN_OR_RETURN(muon_, TorchMuonDefaults(o_.precision));
    if (world_ > 1) {
      if (o_.cuda) {
        NcclOptions nccl;
        nccl.device = rank_;
        nccl.timeout = absl::Seconds(300);
        ASSIGN_OR_RETURN(
            comm_, CreateNcclCommunicator(&store_, "bench/gtp", rank_, world_,
                                          backend_->stream(), nccl));
      } else {
        GlooOptions gloo;
        gloo.hostname = "127.0.0.1";
        gloo.timeout = absl::Seconds(300);
        ASSIGN_OR_RETURN(comm_, CreateGlooCommunicator(&store_, "bench/gtp",
                                                       rank_, world_, gloo));
      }
    }
    RETURN_IF_ERROR(Allocate());
    RankResult result;
    ASSIGN_OR_RETURN(result.sharded, Sharded(&result.exchange_bytes));
    ASSIGN_OR_RETURN(std::vector<float> sharded_params, Params());
    RETURN_IF_ERROR(Reset());
    ASSIGN_OR_RETURN(result.duplicated, Duplicated());
    ASSIGN_OR_RETURN(std::vector<float> duplicated_params, Params());
    for (size_t i = 0; i < sharded_params.size(); ++i) {
      result.max_abs_diff =
          std::max(result.max_abs_diff,
                   double(std::fabs(sharded_params[i] - duplicated_params[i])));
    }
    ASSIGN_OR_RETURN(result.raw_a2a_us, RawAllToAll(result.exchange_bytes));
    return result;
  }

 private:
  absl::Status Allocate() {
    for (size_t m = 0; m < o_.shapes.size(); ++m) {
      const auto [rows, cols] = o_.shapes[m];
      Shard s{rows / world_, cols, rows};
      ASSIGN_OR_RETURN(s.param, backend_->Allocate(s.rows * cols * 4));
      ASSIGN_OR_RETURN(s.grad, backend_->Allocate(s.rows * cols * 4));
      shards_.push_back(s);
    }
    return Reset();
  }

  absl::Status Reset() {
    for (size_t m = 0; m < shards_.size(); ++m) {
      RETURN_IF_ERROR(Fill(*backend_, shards_[m], int(m),
                           int64_t(rank_) * shards_[m].rows));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<float>> Params() {
    std::vector<float> out;
    for (const Shard& s : shards_) {
      std::vector<float> host(s.rows * s.cols);
      RETURN_IF_ERROR(
          backend_->CopyToHost(host.data(), s.param, host.size() * 4));
      out.insert(out.end(), host.begin(), host.end());
    }
    return out;
  }

  // The step engine in an N x 1 domain with LPT homes.
  absl::StatusOr<PhaseTimings> Sharded(double* exchange_bytes) {
    GroupConfig group;
    group.name = "bench";
    group.muon = muon_;
    group.domain.size = DomainSize{world_, 1};
    group.domain.g = rank_;
    group.domain.gtp = comm_.get();
    std::vector<ParamShardSpec> specs;
    for (size_t m = 0; m < shards_.size(); ++m) {
      const Shard& s = shards_[m];
      ParamBinding p;
      p.name = absl::StrCat("m", m);
      p.full_shape = {s.full_rows, s.cols};
      p.tags.is_gtp_weight_remat = world_ > 1;
      p.param = ContiguousView(s.param, DType::kFloat32, s.rows, s.cols);
      p.grad = ContiguousView(s.grad, DType::kFloat32, s.rows, s.cols);
      ASSIGN_OR_RETURN(
          ParamShardSpec spec,
          MakeShardSpecFromFullShape(p.name, p.full_shape, -1, world_ > 1, 0,
                                     DomainSize{world_, 1}));
      specs.push_back(std::move(spec));
      group.params.push_back(std::move(p));
    }
    ASSIGN_OR_RETURN(HomePlan homes, PlanNsHomes(specs, DomainSize{world_, 1}));
    // Every rank but the home sends its shard to the home.
    const int64_t elem = int64_t(DTypeSize(NsWorkDType(muon_.ns.precision)));
    *exchange_bytes = 0;
    for (const Shard& s : shards_) {
      *exchange_bytes += double(world_ - 1) * s.rows * s.cols * elem;
    }
    std::vector<GroupConfig> groups;
    groups.push_back(std::move(group));
    ASSIGN_OR_RETURN(auto engine, LayerShardedMuon::Create(backend_.get(),
                                                           std::move(groups)));
    RETURN_IF_ERROR(engine->SetHomes("bench", homes.homes));
    std::vector<PhaseTimings> timings;
    for (int step = 0; step < o_.warmup + o_.steps; ++step) {
      ASSIGN_OR_RETURN(StepResult r, engine->Step({}));
      if (step >= o_.warmup) timings.push_back(r.timings);
    }
    return MedianTimings(timings);
  }

  // Every rank all-gathers every momentum matrix and runs NS on all of
  // them (rows split without padding, so the gathered rows are the matrix).
  absl::StatusOr<PhaseTimings> Duplicated() {
    const DType ns_dtype = NsWorkDType(muon_.ns.precision);
    const int64_t elem = int64_t(DTypeSize(ns_dtype));
    std::vector<void*> momenta, locals, fulls;
    std::map<std::pair<int64_t, int64_t>, std::unique_ptr<NewtonSchulz>> ns;
    for (const Shard& s : shards_) {
      const int64_t n = s.rows * s.cols;
      ASSIGN_OR_RETURN(void* m, backend_->Allocate(n * 4));
      std::vector<float> zeros(n, 0.0f);
      RETURN_IF_ERROR(backend_->CopyFromHost(m, zeros.data(), n * 4));
      ASSIGN_OR_RETURN(void* local, backend_->Allocate(n * elem));
      void* full = local;  // one rank: the local rows are the matrix
      if (comm_ != nullptr) {
        ASSIGN_OR_RETURN(full, backend_->Allocate(n * world_ * elem));
      }
      momenta.push_back(m);
      locals.push_back(local);
      fulls.push_back(full);
      auto& engine = ns[{s.full_rows, s.cols}];
      if (engine == nullptr) {
        ASSIGN_OR_RETURN(engine, NewtonSchulz::Create(backend_.get(), muon_.ns,
                                                      s.full_rows, s.cols));
      }
    }
    RETURN_IF_ERROR(backend_->Synchronize());
    auto lap = [&](absl::Time& t0, double& into) -> absl::Status {
      RETURN_IF_ERROR(backend_->Synchronize());
      if (comm_ != nullptr) RETURN_IF_ERROR(comm_->Wait());
      const absl::Time now = absl::Now();
      into = absl::ToDoubleMicroseconds(now - t0);
      t0 = now;
      return absl::OkStatus();
    };
    std::vector<PhaseTimings> timings;
    for (int step = 0; step < o_.warmup + o_.steps; ++step) {
      PhaseTimings t;
      const absl::Time start = absl::Now();
      absl::Time t0 = start;
      for (size_t m = 0; m < shards_.size(); ++m) {
        const Shard& s = shards_[m];
        RETURN_IF_ERROR(MuonMomentumPhase(
            *backend_, muon_,
            ContiguousView(s.grad, DType::kFloat32, s.rows, s.cols),
            ContiguousView(momenta[m], DType::kFloat32, s.rows, s.cols),
            ContiguousView(locals[m], ns_dtype, s.rows, s.cols)));
      }
      RETURN_IF_ERROR(lap(t0, t.momentum_us));
      for (size_t m = 0; m < shards_.size(); ++m) {
        const Shard& s = shards_[m];
        if (comm_ == nullptr) continue;
        RETURN_IF_ERROR(
            comm_->AllGather(locals[m], s.rows * s.cols, fulls[m], ns_dtype));
      }
      RETURN_IF_ERROR(lap(t0, t.a2a_fwd_us));
      for (size_t m = 0; m < shards_.size(); ++m) {
        const Shard& s = shards_[m];
        const MatrixView full =
            ContiguousView(fulls[m], ns_dtype, s.full_rows, s.cols);
        NewtonSchulz& engine = *ns[std::make_pair(s.full_rows, s.cols)];
        RETURN_IF_ERROR(
            engine.Run(full, NsResultOver(full, engine.result_dtype()), 1));
      }
      RETURN_IF_ERROR(lap(t0, t.ns_us));
      for (size_t m = 0; m < shards_.size(); ++m) {
        const Shard& s = shards_[m];
        ASSIGN_OR_RETURN(float lr, MuonAdjustedLr(muon_, s.full_rows, s.cols));
        void* mine =
            static_cast<char*>(fulls[m]) + rank_ * s.rows * s.cols * elem;
        const MatrixView update =
            NsResultOver(ContiguousView(mine, ns_dtype, s.rows, s.cols),
                         NsResultDType(muon_.ns, s.full_rows, s.cols));
        RETURN_IF_ERROR(MuonUpdatePhase(
            *backend_, muon_,
            ContiguousView(s.param, DType::kFloat32, s.rows, s.cols), update,
            lr));
      }
      RETURN_IF_ERROR(lap(t0, t.update_us));
      t.total_us = absl::ToDoubleMicroseconds(absl::Now() - start);
      if (step >= o_.warmup) timings.push_back(t);
    }
    for (size_t m = 0; m < shards_.size(); ++m) {
      backend_->Free(momenta[m]);
      if (fulls[m] != locals[m]) backend_->Free(fulls[m]);
      backend_->Free(locals[m]);
    }
    return MedianTimings(timings);
  }

  // One all_to_allv of `total_bytes` over all ranks, split evenly over the
  // ordered rank pairs (no self-copies), in the NS work dtype.
  absl::StatusOr<double> RawAllToAll(double total_bytes) {
    if (comm_ == nullptr) return 0.0;
    const DType dtype = NsWorkDType(muon_.ns.precision);
    const int64_t elem = int64_t(DTypeSize(dtype));
    const int64_t per_peer =
        int64_t(total_bytes / (double(world_) * (world_ - 1)) / elem);
    std::vector<int64_t> counts(world_, per_peer);
    counts[rank_] = 0;
    const int64_t bytes = per_peer * (world_ - 1) * elem;
    ASSIGN_OR_RETURN(void* send,
                     backend_->Allocate(std::max<int64_t>(bytes, 1)));
    ASSIGN_OR_RETURN(void* recv,
                     backend_->Allocate(std::max<int64_t>(bytes, 1)));
    std::vector<double> times;
    for (int rep = 0; rep < o_.warmup + o_.steps; ++rep) {
      RETURN_IF_ERROR(comm_->Barrier());
      RETURN_IF_ERROR(comm_->Wait());
      const absl::Time t0 = absl::Now();
      RETURN_IF_ERROR(comm_->AllToAllV(send, counts, recv, counts, dtype));
      RETURN_IF_ERROR(comm_->Wait());
      if (rep >= o_.warmup) {
        times.push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      }
    }
    backend_->Free(send);
    backend_->Free(recv);
    return Median(times);
  }

  const Options& o_;
  const int rank_, world_;
  const std::string dir_;
  FileKeyValueStore store_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Communicator> comm_;
  MuonOptions muon_;
  std::vector<Shard> shards_;
};

void WriteResult(const std::string& path, const RankResult& r) {
  std::ofstream out(path);
  out.precision(17);
  for (const PhaseTimings* t : {&r.sharded, &r.duplicated}) {
    out << t->momentum_us << " " << t->a2a_fwd_us << " " << t->ns_us << " "
        << t->a2a_bwd_us << " " << t->update_us << " " << t->total_us << "\n";
  }
  out << r.raw_a2a_us << " " << r.exchange_bytes << " " << r.max_abs_diff
      << "\n";
}

bool ReadResult(const std::string& path, RankResult* r) {
  std::ifstream in(path);
  for (PhaseTimings* t : {&r->sharded, &r->duplicated}) {
    in >> t->momentum_us >> t->a2a_fwd_us >> t->ns_us >> t->a2a_bwd_us >>
        t->update_us >> t->total_us;
  }
  in >> r->raw_a2a_us >> r->exchange_bytes >> r->max_abs_diff;
  return bool(in);
}

// Runs N processes; returns their results, or an empty vector (messages on
// stderr) if any failed.
std::vector<RankResult> RunWorld(const Options& o, int world) {
  char tmpl[] = "/tmp/muond-scaling-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return {};
  const std::string dir = tmpl;
  mkdir((dir + "/store").c_str(), 0700);
  std::vector<pid_t> pids;
  std::fflush(stdout);  // or the children inherit (and may repeat) it
  std::fflush(stderr);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      Rank rank(o, r, world, dir);
      absl::StatusOr<RankResult> result = rank.Run();
      if (!result.ok()) {
        std::fprintf(stderr, "scaling_bench: rank %d of %d: %s\n", r, world,
                     result.status().ToString().c_str());
        _exit(1);
      }
      WriteResult(absl::StrCat(dir, "/rank", r), *result);
      _exit(0);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::vector<RankResult> results(world);
  for (int r = 0; r < world && ok; ++r) {
    ok = ReadResult(absl::StrCat(dir, "/rank", r), &results[r]);
  }
  std::filesystem::remove_all(dir);
  if (!ok) return {};
  return results;
}

struct Summary {
  int world = 0;
  double ns_slowest_sharded = 0, ns_slowest_duplicated = 0;
};

// Prints the rows of one N and returns what the speedup lines need.
Summary Report(int world, const std::vector<RankResult>& rs) {
  auto mean = [&](auto get) {
    double s = 0;
    for (const RankResult& r : rs) s += get(r);
    return s / rs.size();
  };
  auto most = [&](auto get) {
    double m = 0;
    for (const RankResult& r : rs) m = std::max(m, get(r));
    return m;
  };
  Summary out{world};
  for (bool sharded : {true, false}) {
    auto t = [sharded](const RankResult& r) -> const PhaseTimings& {
      return sharded ? r.sharded : r.duplicated;
    };
    const double ns_mean = mean([&](auto& r) { return t(r).ns_us; });
    const double ns_most = most([&](auto& r) { return t(r).ns_us; });
    (sharded ? out.ns_slowest_sharded : out.ns_slowest_duplicated) = ns_most;
    std::printf(
        "| %d | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.3f |\n", world,
        sharded ? "sharded" : "duplicated",
        most([&](auto& r) { return t(r).total_us; }) / 1e3,
        mean([&](auto& r) { return t(r).momentum_us; }) / 1e3,
        mean([&](auto& r) { return t(r).a2a_fwd_us; }) / 1e3, ns_mean / 1e3,
        mean([&](auto& r) { return t(r).a2a_bwd_us; }) / 1e3,
        mean([&](auto& r) { return t(r).update_us; }) / 1e3,
        ns_mean > 0 ? ns_most / ns_mean : 1.0);
  }
  return out;
}

bool ParseArgs(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      const size_t n = std::strlen(name);
      return arg.compare(0, n, name) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = value("--shapes=")) {
      for (absl::string_view tok : absl::StrSplit(v, ',')) {
        long r = 0, c = 0, k = 1;
        const std::string s(tok);
        const int got = std::sscanf(s.c_str(), "%ldx%ld*%ld", &r, &c, &k);
        if (got < 2 || r < 1 || c < 1 || k < 1) {
          std::fprintf(stderr, "--shapes: bad entry '%s' (RxC or RxC*K)\n",
                       s.c_str());
          return false;
        }
        for (long j = 0; j < k; ++j) o->shapes.push_back({r, c});
      }
    } else if (const char* v = value("--ranks=")) {
      for (absl::string_view tok : absl::StrSplit(v, ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(tok, &n) || n < 1) {
          std::fprintf(stderr, "--ranks: '%s' is not a count >= 1\n",
                       std::string(tok).c_str());
          return false;
        }
        o->ranks.push_back(n);
      }
    } else if (const char* v = value("--device=")) {
      if (std::strcmp(v, "cuda") != 0 && std::strcmp(v, "cpu") != 0) {
        std::fprintf(stderr, "--device: cuda or cpu, got '%s'\n", v);
        return false;
      }
      o->cuda = std::strcmp(v, "cuda") == 0;
    } else if (const char* v = value("--precision=")) {
      o->precision = v;
      if (o->precision != "highest" && o->precision != "high" &&
          o->precision != "medium") {
        std::fprintf(stderr, "--precision: highest, high or medium\n");
        return false;
      }
    } else if (const char* v = value("--steps=")) {
      o->steps = std::atoi(v);
    } else if (const char* v = value("--warmup=")) {
      o->warmup = std::atoi(v);
    } else {
      std::fprintf(stderr, "unknown argument '%s'\n", arg.c_str());
      return false;
    }
  }
  if (o->shapes.empty() || o->ranks.empty() || o->steps < 1 || o->warmup < 0) {
    std::fprintf(stderr, "--shapes and --ranks are required; --steps >= 1\n");
    return false;
  }
  for (int n : o->ranks) {
    for (const auto& [r, c] : o->shapes) {
      if (r % n != 0) {
        std::fprintf(stderr,
                     "--shapes: %ldx%ld rows are not divisible by %d "
                     "ranks\n",
                     long(r), long(c), n);
        return false;
      }
    }
  }
  return true;
}

int Main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, &o)) {
    std::fprintf(stderr,
                 "usage: scaling_bench --shapes=RxC[*K],... --ranks=N,... "
                 "[--device=cuda|cpu] [--precision=medium|highest|high] "
                 "[--steps=10] [--warmup=2]\n");
    return 2;
  }
  std::printf("%zu matrices, %s, %s, %d steps (median)\n\n", o.shapes.size(),
              o.cuda ? "cuda + nccl" : "cpu + gloo", o.precision.c_str(),
              o.steps);
  std::printf(
      "| ranks | mode | step ms (slowest rank) | momentum | exchange / "
      "all-gather | NS | exchange back | update | NS slowest / mean "
      "|\n|---|---|---|---|---|---|---|---|---|\n");
  std::vector<Summary> summaries;
  std::vector<std::string> lines;
  bool agree = true;
  for (int world : o.ranks) {
    std::vector<RankResult> rs = RunWorld(o, world);
    if (rs.empty()) {
      std::fprintf(stderr, "scaling_bench: the %d-rank run failed\n", world);
      return 1;
    }
    summaries.push_back(Report(world, rs));
    double diff = 0, fwd = 0, raw = 0;
    for (const RankResult& r : rs) {
      diff = std::max(diff, r.max_abs_diff);
      fwd = std::max(fwd, r.sharded.a2a_fwd_us);
      raw = std::max(raw, r.raw_a2a_us);
    }
    if (o.precision == "highest" && diff != 0) agree = false;
    std::string line = absl::StrCat(world,
                                    " ranks: sharded vs duplicated "
                                    "params max |diff| ",
                                    diff);
    if (world > 1 && fwd > 0 && raw > 0) {
      const double bytes = rs[0].exchange_bytes;
      absl::StrAppend(&line, "; forward exchange ", bytes / fwd / 1e3,
                      " GB/s vs raw all_to_allv of the same bytes ",
                      bytes / raw / 1e3, " GB/s (", raw / fwd, "x)");
    }
    lines.push_back(line);
  }
  std::printf("\n");
  for (const std::string& line : lines) std::printf("%s\n", line.c_str());
  const Summary& base = summaries.front();
  for (const Summary& s : summaries) {
    std::printf(
        "NS time (slowest rank), %d vs %d ranks: sharded %.2fx, "
        "duplicated %.2fx\n",
        s.world, base.world,
        base.ns_slowest_sharded / std::max(s.ns_slowest_sharded, 1e-9),
        base.ns_slowest_duplicated / std::max(s.ns_slowest_duplicated, 1e-9));
  }
  if (!agree) {
    std::fprintf(stderr,
                 "scaling_bench: the sharded and duplicated params "
                 "differ at highest precision\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) {
  muond::ReexecWithBetterOpenBlasCore(argv);  // the daemon's kernels
  return muond::Main(argc, argv);
}
