// One Muon optimizer step over a list of full matrices, muond's core library
// called directly on the CUDA backend (no daemon, no RPC): momentum ->
// Newton–Schulz -> scale -> decoupled weight decay + update per matrix
// (MuonStepFullMatrix), one NewtonSchulz workspace per distinct shape. The
// settings mirror torch.optim.Muon's defaults as bench/gpu/step_bench.py
// configures both: simple coefficients x 5, eps 1e-7, `original` scale,
// Nesterov, fp32 params/grads/momentum, NS at --precision (medium = bf16).
//
//   step_bench --shapes=4096x4096,1024x4096,... [--precision=medium]
//              [--reps=20] [--warmup=3] [--ns_batch_size=1] [--use_syrk]
//              [--syrk_block_rows=K]
// --ns_batch_size=N > 1: same-shape matrices run N at a time through one
// batched NewtonSchulz (momentum of each into its slice of a stacked
// scratch, one batched NS, then scale + update per matrix), as the step
// engine's batched path does; 1 is MuonStepFullMatrix per matrix; 0 (with
// --engine) is the engine's default, auto by shape (ns_batch_rule.h).
// --use_syrk: the symmetric NS products everywhere (NsOptions::use_syrk), with
// --syrk_block_rows=K (0 = SymmetricGemmStridedBatchedOut, K >= 1 the legacy
// K lower block rows).
// --engine: the step engine the daemon runs (LayerShardedMuon::Step on a
// 1x1 domain: the batched momentum with the non-finite-gradient check in its
// pass, NS and the update, timed by events with one wait at the commit), so
// daemon minus in-process is the transport alone. Without it, the phase
// functions are chained directly (no check, one synchronize per step).
// --ns_algorithm=standard|gram|auto (default auto, as NsOptions),
// --gram_restarts=I,J|none,
// --gram_dtype=fp16|bf16, --gram_min_aspect_ratio=X: NsOptions' Gram NS
// fields (unset = their defaults).
// --state_location=device|host, --state_dtype=fp32|bf16|fp8_e4m3 (with
// --engine): where and in what precision the engine keeps the momentum
// (core/common/state_storage.h); the engine's line then adds the medians of
// its momentum and update phases ("momentum_ms <ms> update_ms <ms>").
// --double_buffer_momentum (with --engine): MuonOptions' second momentum
// buffer (the commit swaps it in instead of recomputing the momentum).
// --groups=N (with --engine, default 1): the n matrices in N Muon groups,
// matrix i in group floor(i N / n): consecutive runs, so a shape list in
// layer order with as many matrices per layer gives a group per layer for
// N = the layers, as a trainer's per-layer param groups register them.
// --sym_gemm_schedule=auto|cooperative|pingpong|wide: the sm_90a symmetric
// GEMM's consumer schedule (muond-daemon's flag of the same name).
// --ns_only (not with --engine): after one full step, times each chunk's
// batched NS alone (Run on its stacked NS input, in place), one line per
// chunk: "ns_ms <R>x<C> batch <B> median <ms>" (bench/gpu_step_bench.py's
// aspect-ratio sweep).
// The timed steps (and --ns_only's timed runs) sit inside
// cudaProfilerStart/Stop, so a profiler that honours that range
// (bench/gpu/kernel_profile.cc, nsys --capture-range=cudaProfilerApi) sees
// only them.
// Prints one line: "step_ms_median <ms> step_ms_min <ms> matrices <n>"
// (host clock around the step + stream synchronize; with --ns_only, the sum
// of the chunks' NS medians).
#include <cuda_profiler_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/common/torch_muon_defaults.h"
#include "core/backend/cuda_backend.h"
#include "core/backend/cuda_backend_options.h"
#include "core/common/status_macros.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {
namespace {

struct Matrix {
  int64_t rows, cols;
  void *param, *grad, *momentum;
};

void FillRandom(Backend& b, void* p, int64_t n, uint32_t seed, float scale) {
  std::vector<float> h(n);
  uint32_t s = seed * 2654435761u + 1;
  for (auto& x : h) {
    s = s * 1664525u + 1013904223u;
    x = scale * float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23);
  }
  (void)b.CopyFromHost(p, h.data(), n * 4);
  (void)b.Synchronize();
}

// The daemon's step engine over the matrices: `groups` (<= the matrices)
// Muon groups on a 1x1 domain (every NS at home), matrix i in group
// floor(i groups / n), default StepOptions as the daemon uses them.
absl::StatusOr<std::unique_ptr<LayerShardedMuon>> MakeEngine(
    Backend& b, const MuonOptions& o, const std::vector<Matrix>& mats,
    int64_t groups) {
  std::vector<GroupConfig> configs(groups);
  for (int64_t g = 0; g < groups; ++g) {
    configs[g].name = "bench" + std::to_string(g);
    configs[g].muon = o;
  }
  for (size_t i = 0; i < mats.size(); ++i) {
    const Matrix& m = mats[i];
    ParamBinding p;
    p.name = "m" + std::to_string(i);
    p.full_shape = {m.rows, m.cols};
    p.param = ContiguousView(m.param, DType::kFloat32, m.rows, m.cols);
    p.grad = ContiguousView(m.grad, DType::kFloat32, m.rows, m.cols);
    configs[int64_t(i) * groups / int64_t(mats.size())].params.push_back(
        std::move(p));
  }
  std::vector<int64_t> sizes;
  for (const GroupConfig& c : configs) sizes.push_back(c.params.size());
  ASSIGN_OR_RETURN(auto engine,
                   LayerShardedMuon::Create(&b, std::move(configs)));
  for (int64_t g = 0; g < groups; ++g) {
    RETURN_IF_ERROR(engine->SetHomes("bench" + std::to_string(g),
                                     std::vector<NsHome>(sizes[g], NsHome{})));
  }
  return engine;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// --state_location / --state_dtype into o ("" leaves the default).
absl::Status ApplyStateFlags(const std::string& location,
                             const std::string& dtype, MuonOptions& o) {
  if (location == "host") {
    o.state_location = StateLocation::kHost;
  } else if (!location.empty() && location != "device") {
    return absl::InvalidArgumentError("--state_location: device or host, not " +
                                      location);
  }
  const std::pair<const char*, DType> dtypes[] = {
      {"fp32", DType::kFloat32},
      {"bf16", DType::kBFloat16},
      {"fp8_e4m3", DType::kFloat8E4M3}};
  if (dtype.empty()) return absl::OkStatus();
  for (const auto& [name, d] : dtypes) {
    if (dtype == name) {
      o.state_dtype = d;
      return absl::OkStatus();
    }
  }
  return absl::InvalidArgumentError(
      "--state_dtype: fp32, bf16 or fp8_e4m3, not " + dtype);
}

// --gram_restarts: "none" (no restart) or a comma list of iterations.
absl::StatusOr<std::vector<int>> ParseRestarts(const std::string& text) {
  std::vector<int> out;
  if (text == "none") return out;
  for (absl::string_view tok : absl::StrSplit(text, ',')) {
    int v = 0;
    if (!absl::SimpleAtoi(tok, &v))
      return absl::InvalidArgumentError(
          "--gram_restarts: '" + std::string(tok) +
          "' is not an integer (a comma list, or none)");
    out.push_back(v);
  }
  return out;
}

// Applies the Gram NS flags to `ns` (validated later by MuonOptions).
absl::Status ApplyNsFlags(const std::string& algorithm,
                          const std::string& restarts,
                          const std::string& gram_dtype,
                          double min_aspect_ratio, NsOptions& ns) {
  // Every value explicit: NsOptions' default is auto (Gram by shape), so
  // "standard" must not leave it.
  if (algorithm == "gram")
    ns.algorithm = NsAlgorithm::kGram;
  else if (algorithm == "standard")
    ns.algorithm = NsAlgorithm::kStandard;
  else if (algorithm == "auto")
    ns.algorithm = NsAlgorithm::kAuto;
  else
    return absl::InvalidArgumentError(
        "--ns_algorithm: standard, gram or auto, not " + algorithm);
  if (!restarts.empty()) {
    auto r = ParseRestarts(restarts);
    if (!r.ok()) return r.status();
    ns.gram_restarts = *r;
  }
  if (gram_dtype == "bf16")
    ns.gram_dtype = DType::kBFloat16;
  else if (gram_dtype != "fp16")
    return absl::InvalidArgumentError("--gram_dtype: fp16 or bf16, not " +
                                      gram_dtype);
  ns.gram_min_aspect_ratio = min_aspect_ratio;
  return absl::OkStatus();
}

int Fail(const absl::Status& st) {
  std::fprintf(stderr, "step_bench: %s\n", st.ToString().c_str());
  return 1;
}

using NsMap =
    std::map<std::pair<int64_t, int64_t>, std::unique_ptr<NewtonSchulz>>;

// --ns_only: per chunk, the momentum phase fills its stacked NS input (real
// data: NS's time must not depend on garbage), then its batched NS alone is
// timed, in place (each rep re-orthogonalises the last output, so the
// values stay normalised).
int TimeNsOnly(Backend& b, const MuonOptions& o, NsMap& ns,
               const std::vector<Matrix>& mats,
               const std::vector<std::vector<size_t>>& chunks, void* scratch,
               int reps, int warmup) {
  const DType dt = NsWorkDType(o.ns.precision);
  double total = 0;
  for (const auto& ch : chunks) {
    const Matrix& first = mats[ch.front()];
    const int64_t r = first.rows, c = first.cols, batch = int64_t(ch.size());
    char* base = static_cast<char*>(scratch);
    const int64_t bytes = r * c * int64_t(DTypeSize(dt));
    std::vector<MatrixView> grads, moms, slots;
    for (int64_t k = 0; k < batch; ++k) {
      const Matrix& m = mats[ch[k]];
      grads.push_back(ContiguousView(m.grad, DType::kFloat32, r, c));
      moms.push_back(ContiguousView(m.momentum, DType::kFloat32, r, c));
      slots.push_back(ContiguousView(base + k * bytes, dt, r, c));
    }
    if (auto st = MuonMomentumPhaseBatch(b, o, grads, moms, slots); !st.ok())
      return Fail(st);
    const MatrixView stacked = ContiguousView(base, dt, batch * r, c);
    NewtonSchulz& engine = *ns[{r, c}];
    std::vector<double> t;
    for (int i = 0; i < warmup + reps; ++i) {
      if (i == warmup) {
        // The range starts with the GPU idle: no earlier work counts.
        if (auto st = b.Synchronize(); !st.ok()) return Fail(st);
        cudaProfilerStart();
      }
      const auto t0 = std::chrono::steady_clock::now();
      if (auto st = engine.Run(
              stacked, NsResultOver(stacked, engine.result_dtype()), batch);
          !st.ok())
        return Fail(st);
      if (auto st = b.Synchronize(); !st.ok()) return Fail(st);
      if (i >= warmup)
        t.push_back(std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - t0)
                        .count());
    }
    cudaProfilerStop();
    std::sort(t.begin(), t.end());
    std::printf("ns_ms %ldx%ld batch %ld median %.4f\n", long(r), long(c),
                long(batch), t[t.size() / 2]);
    total += t[t.size() / 2];
  }
  std::printf("step_ms_median %.4f step_ms_min %.4f matrices %zu\n", total,
              total, mats.size());
  return 0;
}

int Main(int argc, char** argv) {
  std::string shapes, precision = "medium";
  int reps = 20, warmup = 3;
  int64_t ns_batch = 1;
  bool use_syrk = false, engine_mode = false, ns_only = false;
  bool double_buffer_momentum = false;
  int syrk_block_rows = 0;
  std::string ns_algorithm = "auto", gram_restarts, gram_dtype = "fp16";
  std::string state_location, state_dtype, sym_gemm_schedule = "auto";
  double gram_min_aspect_ratio = 0.0;
  int64_t groups = 1;
  for (int i = 1; i < argc; ++i) {
    if (!std::strncmp(argv[i], "--shapes=", 9))
      shapes = argv[i] + 9;
    else if (!std::strncmp(argv[i], "--precision=", 12))
      precision = argv[i] + 12;
    else if (!std::strncmp(argv[i], "--reps=", 7))
      reps = std::atoi(argv[i] + 7);
    else if (!std::strncmp(argv[i], "--warmup=", 9))
      warmup = std::atoi(argv[i] + 9);
    else if (!std::strncmp(argv[i], "--ns_batch_size=", 16))
      ns_batch = std::atoll(argv[i] + 16);
    else if (!std::strcmp(argv[i], "--use_syrk"))
      use_syrk = true;
    else if (!std::strcmp(argv[i], "--engine"))
      engine_mode = true;
    else if (!std::strcmp(argv[i], "--double_buffer_momentum"))
      double_buffer_momentum = true;
    else if (!std::strncmp(argv[i], "--syrk_block_rows=", 18))
      syrk_block_rows = std::atoi(argv[i] + 18);
    else if (!std::strcmp(argv[i], "--ns_only"))
      ns_only = true;
    else if (!std::strncmp(argv[i], "--ns_algorithm=", 15))
      ns_algorithm = argv[i] + 15;
    else if (!std::strncmp(argv[i], "--gram_restarts=", 16))
      gram_restarts = argv[i] + 16;
    else if (!std::strncmp(argv[i], "--gram_dtype=", 13))
      gram_dtype = argv[i] + 13;
    else if (!std::strncmp(argv[i], "--gram_min_aspect_ratio=", 24))
      gram_min_aspect_ratio = std::atof(argv[i] + 24);
    else if (!std::strncmp(argv[i], "--state_location=", 17))
      state_location = argv[i] + 17;
    else if (!std::strncmp(argv[i], "--state_dtype=", 14))
      state_dtype = argv[i] + 14;
    else if (!std::strncmp(argv[i], "--sym_gemm_schedule=", 20))
      sym_gemm_schedule = argv[i] + 20;
    else if (!std::strncmp(argv[i], "--groups=", 9)) {
      if (!absl::SimpleAtoi(argv[i] + 9, &groups) || groups < 1) {
        std::fprintf(stderr, "step_bench: %s: must be an integer >= 1\n",
                     argv[i]);
        return 2;
      }
    } else {
      std::fprintf(
          stderr,
          "usage: step_bench --shapes=RxC,... "
          "[--precision=highest|high|medium] [--reps=N] "
          "[--warmup=N] [--ns_batch_size=N] [--use_syrk] "
          "[--syrk_block_rows=K] [--engine] [--ns_only] "
          "[--ns_algorithm=standard|gram|auto] [--gram_restarts=I,J|none] "
          "[--gram_dtype=fp16|bf16] [--gram_min_aspect_ratio=X] "
          "[--state_location=device|host] "
          "[--state_dtype=fp32|bf16|fp8_e4m3] [--double_buffer_momentum] "
          "[--sym_gemm_schedule=auto|cooperative|pingpong|wide] "
          "[--groups=N]\n");
      return 2;
    }
  }
  if (shapes.empty()) {
    std::fprintf(stderr, "step_bench: --shapes=RxC,... is required\n");
    return 2;
  }
  if (groups > 1 && !engine_mode) {
    std::fprintf(stderr,
                 "step_bench: --groups=%lld: more than one group needs "
                 "--engine\n",
                 (long long)groups);
    return 2;
  }
  if (const int64_t n = int64_t(
          std::vector<absl::string_view>(absl::StrSplit(shapes, ',')).size());
      groups > n) {
    std::fprintf(stderr,
                 "step_bench: --groups=%lld: more groups than the %lld "
                 "matrices of --shapes\n",
                 (long long)groups, (long long)n);
    return 2;
  }
  if (ns_only && engine_mode) {
    std::fprintf(stderr,
                 "step_bench: --ns_only times the chain's NS; not with "
                 "--engine\n");
    return 2;
  }
  // The CUDA backend switches from the same environment variables that
  // default muond-daemon's flags (MUOND_CUDA_GRAPHS, MUOND_CUBLAS_GEMMEX,
  // MUOND_LT_AUTOTUNE; core reads none itself).
  CudaBackendOptions cuda_options = CudaBackendOptionsFromLegacyEnvironment(
      [](const char* n) { return std::getenv(n); });
  const std::optional<SymGemmSchedule> schedule =
      ParseSymGemmSchedule(sym_gemm_schedule);
  if (!schedule.has_value()) {
    std::fprintf(stderr,
                 "step_bench: --sym_gemm_schedule must be auto, cooperative, "
                 "pingpong or wide\n");
    return 2;
  }
  cuda_options.sym_gemm_schedule = *schedule;
  auto backend_or = MakeCudaBackend(0, cuda_options);
  if (!backend_or.ok()) return Fail(backend_or.status());
  Backend& b = **backend_or;

  absl::StatusOr<MuonOptions> defaults = TorchMuonDefaults(precision);
  if (!defaults.ok()) return Fail(defaults.status());
  MuonOptions o = *defaults;
  if (ns_batch < 1 && !(engine_mode && ns_batch == 0))
    return Fail(absl::InvalidArgumentError(
        "--ns_batch_size >= 1 (0, auto by shape: with --engine only)"));
  o.ns_batch_size = ns_batch;
  o.ns.use_syrk = use_syrk;
  o.ns.syrk_block_rows = syrk_block_rows;
  if (auto st = ApplyNsFlags(ns_algorithm, gram_restarts, gram_dtype,
                             gram_min_aspect_ratio, o.ns);
      !st.ok())
    return Fail(st);
  if (auto st = ApplyStateFlags(state_location, state_dtype, o); !st.ok())
    return Fail(st);
  o.double_buffer_momentum = double_buffer_momentum;
  if (auto st = o.Validate(); !st.ok()) return Fail(st);

  std::vector<Matrix> mats;
  NsMap ns;
  int64_t max_numel = 0;
  for (size_t pos = 0; pos < shapes.size();) {
    size_t end = shapes.find(',', pos);
    if (end == std::string::npos) end = shapes.size();
    const std::string tok = shapes.substr(pos, end - pos);
    pos = end + 1;
    long r = 0, c = 0;
    if (std::sscanf(tok.c_str(), "%ldx%ld", &r, &c) != 2 || r < 1 || c < 1)
      return Fail(absl::InvalidArgumentError("--shapes: bad entry " + tok));
    Matrix m{r, c, nullptr, nullptr, nullptr};
    for (void** p : {&m.param, &m.grad, &m.momentum}) {
      auto a = b.Allocate(r * c * 4);
      if (!a.ok()) return Fail(a.status());
      *p = *a;
    }
    const uint32_t seed = uint32_t(mats.size());
    FillRandom(b, m.param, r * c, 3 * seed, 0.02f);
    FillRandom(b, m.grad, r * c, 3 * seed + 1, 1e-3f);
    (void)b.Memset0(ContiguousView(m.momentum, DType::kFloat32, r, c));
    mats.push_back(m);
  }
  // Chunks of up to ns_batch same-shape matrices, in first-seen shape order.
  // --engine: none (the step engine chunks, ns_batch 0 included, and keeps
  // its own NS workspaces and buffers; the chain's would only take memory).
  std::vector<std::vector<size_t>> chunks;
  if (!engine_mode) {
    std::map<std::pair<int64_t, int64_t>, std::vector<size_t>> by_shape;
    std::vector<std::pair<int64_t, int64_t>> order;
    for (size_t i = 0; i < mats.size(); ++i) {
      const auto key = std::make_pair(mats[i].rows, mats[i].cols);
      if (!by_shape.count(key)) order.push_back(key);
      by_shape[key].push_back(i);
    }
    if (ns_batch == 1) {
      for (size_t i = 0; i < mats.size(); ++i) chunks.push_back({i});
    } else {
      for (const auto& key : order) {
        const auto& idx = by_shape[key];
        for (size_t k = 0; k < idx.size(); k += size_t(ns_batch))
          chunks.emplace_back(
              idx.begin() + k,
              idx.begin() + std::min(idx.size(), k + size_t(ns_batch)));
      }
    }
  }
  for (const auto& ch : chunks) {
    const Matrix& m = mats[ch.front()];
    const int64_t batch = int64_t(ch.size());
    max_numel = std::max<int64_t>(max_numel, batch * m.rows * m.cols);
    auto& slot = ns[{m.rows, m.cols}];
    if (!slot || slot->max_batch() < batch) {
      auto n = NewtonSchulz::Create(
          &b, o.ns, m.rows, m.cols,
          ns_batch == 1 ? 1 : std::min<int64_t>(ns_batch, batch));
      if (!n.ok()) return Fail(n.status());
      slot = std::move(*n);
    }
  }
  // The NS input/output in NS's work dtype, as the step engine keeps it.
  const DType ns_dtype = NsWorkDType(o.ns.precision);
  auto scratch = b.Allocate(std::max<int64_t>(max_numel, 1) *
                            int64_t(DTypeSize(ns_dtype)));
  if (!scratch.ok()) return Fail(scratch.status());

  auto step = [&]() -> absl::Status {
    for (const auto& ch : chunks) {
      const Matrix& first = mats[ch.front()];
      const int64_t r = first.rows, c = first.cols, batch = int64_t(ch.size());
      NewtonSchulz& engine = *ns[{r, c}];
      const auto v = [&](void* p) {
        return ContiguousView(p, DType::kFloat32, r, c);
      };
      const auto ns_view = [&](void* p, int64_t rows) {
        return ContiguousView(p, ns_dtype, rows, c);
      };
      if (ns_batch == 1) {
        absl::Status st =
            MuonStepFullMatrix(b, o, engine, v(first.param), v(first.grad),
                               v(first.momentum), ns_view(*scratch, r));
        if (!st.ok()) return st;
        continue;
      }
      // Momentum and update batched over the chunk, as the step engine does.
      char* base = static_cast<char*>(*scratch);
      const int64_t bytes = r * c * int64_t(DTypeSize(ns_dtype));
      auto adjusted_lr = MuonAdjustedLr(o, r, c);
      if (!adjusted_lr.ok()) return adjusted_lr.status();
      std::vector<MatrixView> grads, moms, slots, params;
      for (int64_t k = 0; k < batch; ++k) {
        const Matrix& m = mats[ch[k]];
        grads.push_back(v(m.grad));
        moms.push_back(v(m.momentum));
        slots.push_back(ns_view(base + k * bytes, r));
        params.push_back(v(m.param));
      }
      const std::vector<float> lrs(size_t(batch), *adjusted_lr);
      if (auto st = MuonMomentumPhaseBatch(b, o, grads, moms, slots); !st.ok())
        return st;
      const MatrixView stacked = ns_view(base, batch * r);
      // The result over the input in its own dtype, as the engine leaves it.
      const DType result = engine.result_dtype();
      if (auto st = engine.Run(stacked, NsResultOver(stacked, result), batch);
          !st.ok())
        return st;
      for (MatrixView& slot : slots) slot = NsResultOver(slot, result);
      if (auto st = MuonUpdatePhaseBatch(b, o, params, slots, lrs); !st.ok())
        return st;
    }
    return b.Synchronize();
  };
  std::unique_ptr<LayerShardedMuon> step_engine;
  std::vector<double> momentum_ms, update_ms;  // --engine: per step
  std::function<absl::Status()> run = step;
  if (engine_mode) {
    auto e = MakeEngine(b, o, mats, groups);
    if (!e.ok()) return Fail(e.status());
    step_engine = std::move(*e);
    run = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(StepResult r, step_engine->Step({}));
      momentum_ms.push_back(r.timings.momentum_us / 1000.0);
      update_ms.push_back(r.timings.update_us / 1000.0);
      return absl::OkStatus();
    };
  }
  for (int i = 0; i < warmup; ++i)
    if (auto st = run(); !st.ok()) return Fail(st);
  if (ns_only)
    return TimeNsOnly(b, o, ns, mats, chunks, *scratch, reps, warmup);
  std::vector<double> t;
  if (auto st = b.Synchronize(); !st.ok()) return Fail(st);
  cudaProfilerStart();
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    if (auto st = run(); !st.ok()) return Fail(st);
    t.push_back(std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - t0)
                    .count());
  }
  if (auto st = b.Synchronize(); !st.ok()) return Fail(st);
  cudaProfilerStop();
  std::sort(t.begin(), t.end());
  std::printf("step_ms_median %.4f step_ms_min %.4f matrices %zu",
              t[t.size() / 2], t.front(), mats.size());
  if (engine_mode) {
    std::printf(" momentum_ms %.4f update_ms %.4f", Median(momentum_ms),
                Median(update_ms));
  }
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) { return muond::Main(argc, argv); }
