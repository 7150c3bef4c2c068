// Newton–Schulz throughput relative to the GEMM ceiling of the same backend,
// measured side by side in one run (bench/README.md).
//
// For each shape (rows x cols, m = min, n = max) and precision:
//   NS rate   = 5 * (4 m^2 n + 2 m^3) / t_ns          (standard NS FLOPs)
//   GEMM rate = 2 m^2 n / t_gemm for C(m x n) = B(m x m) X(m x n), the
//               dominant NS product, at the same precision and dtypes
//   ratio     = NS rate / GEMM rate (1.0 = NS runs at GEMM speed)
// The syrk rows count the full FLOPs too, so their ratio is the effective
// speed-up of the symmetric path over plain GEMM speed.
//
//   ns_bench --backend=cpu|cuda [--shapes=SET|RxC,...] [--reps=N]
//            [--precisions=all|medium] [--detail] [--batch=N]
//            [--syrk_block_rows=K,...]
// SET: square, llama (Llama-3-8B), qwen (Qwen3-1.7B), moe (Qwen3-30B-A3B
// experts) or all (square + llama). --batch=N runs N same-shape matrices
// through one batched NS (the step engine's ns_batch_size) against a strided
// batched GEMM of N. --syrk_block_rows lists the use_syrk rows to time
// (default: 0 = SymmetricGemmStridedBatchedOut; K >= 1 the legacy K lower
// block rows). The plain medium row already takes the symmetric products
// where the backend's kernel is faster (Backend::FastSymmetricGemm).
// --detail (CUDA, medium) adds one row per shape timing the NS pieces alone:
// Gram, A^2 (separate output), the X update (separate output), the
// normalisation and the final bf16 -> fp32 copy (TFLOP/s in brackets).
// Environment (CUDA backend; core reads none, so this bench passes them on as
// CudaBackendOptions through CudaBackendOptionsFromLegacyEnvironment, the
// defaults of muond-daemon's flags): MUOND_CUBLAS_GEMMEX=1 uses the legacy
// cublasGemmEx path (--cublas_gemmex); MUOND_LT_AUTOTUNE=N times cublasLt's
// first N algorithms (--lt_autotune); MUOND_CUDA_GRAPHS=0 turns off CUDA
// graph capture (--cuda_graphs).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/backend/cuda_backend_options.h"
#include "core/backend/openblas_core.h"
#include "core/muon/newton_schulz.h"

namespace muond {
namespace {

struct Shape {
  std::string name;
  int64_t rows, cols;
};

double Seconds(Backend& b, int reps, const std::function<void()>& f) {
  f();  // warm-up
  (void)b.Synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    (void)b.Synchronize();
    t.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void Fill(Backend& b, void* p, int64_t n, DType dtype) {
  std::vector<float> h(n);
  uint32_t s = 12345;
  for (auto& x : h) {
    s = s * 1664525u + 1013904223u;
    x = float(int32_t(s >> 8) - (1 << 23)) / float(1 << 23);
  }
  if (dtype == DType::kFloat32) {
    (void)b.CopyFromHost(p, h.data(), n * 4);
  } else {  // upload fp32 to a scratch then convert
    void* tmp = *b.Allocate(n * 4);
    (void)b.CopyFromHost(tmp, h.data(), n * 4);
    (void)b.Copy2D(ContiguousView(p, dtype, 1, n),
                   ContiguousView(tmp, DType::kFloat32, 1, n));
    (void)b.Synchronize();
    b.Free(tmp);
  }
  (void)b.Synchronize();
}

struct Mode {
  MatmulPrecision precision;
  bool syrk;
  int syrk_block_rows;  // 0 = SymmetricGemmStridedBatchedOut
};

std::string ModeName(const Mode& mode) {
  std::string name(MatmulPrecisionName(mode.precision));
  if (!mode.syrk) return name;
  return name + "+syrk" +
         (mode.syrk_block_rows > 0
              ? "(k=" + std::to_string(mode.syrk_block_rows) + ")"
              : "");
}

void Bench(Backend& b, const Shape& s, const Mode& mode, int reps, bool detail,
           int64_t batch) {
  const MatmulPrecision prec = mode.precision;
  const bool syrk = mode.syrk;
  NsOptions o;
  o.precision = prec;
  o.use_syrk = syrk;
  o.syrk_block_rows = mode.syrk_block_rows;
  auto ns_or = NewtonSchulz::Create(&b, o, s.rows, s.cols, batch);
  if (!ns_or.ok()) {
    std::printf("| %s | %ldx%ld | %s | skipped: %s |\n", s.name.c_str(),
                long(s.rows), long(s.cols), ModeName(mode).c_str(),
                std::string(ns_or.status().message()).c_str());
    return;
  }
  auto& ns = **ns_or;
  const int64_t m = std::min(s.rows, s.cols), n = std::max(s.rows, s.cols);
  const DType gd =
      prec == MatmulPrecision::kMedium ? DType::kBFloat16 : DType::kFloat32;
  const int64_t es = int64_t(DTypeSize(gd));
  void* in = *b.Allocate(batch * s.rows * s.cols * 4);
  void* out = *b.Allocate(batch * s.rows * s.cols * 4);
  void* ga = *b.Allocate(batch * m * m * es);
  void* gx = *b.Allocate(batch * m * n * es);
  void* gc = *b.Allocate(batch * m * n * es);
  Fill(b, in, batch * s.rows * s.cols, DType::kFloat32);
  Fill(b, ga, batch * m * m, gd);
  Fill(b, gx, batch * m * n, gd);
  const MatrixView vin =
      ContiguousView(in, DType::kFloat32, batch * s.rows, s.cols);
  const MatrixView vout =
      ContiguousView(out, DType::kFloat32, batch * s.rows, s.cols);
  const double t_ns = Seconds(b, reps, [&] { (void)ns.Run(vin, vout, batch); });
  const double t_gemm = Seconds(b, reps, [&] {
    const MatrixView a = ContiguousView(ga, gd, m, m);
    const MatrixView x = ContiguousView(gx, gd, m, n);
    const MatrixView c = ContiguousView(gc, gd, m, n);
    if (batch == 1) {
      (void)b.Gemm(Op::kN, Op::kN, 1.0f, a, x, 0.0f, c, prec);
    } else {
      (void)b.GemmStridedBatched(Op::kN, Op::kN, 1.0f, a, m * m, x, m * n, 0.0f,
                                 c, m * n, batch, prec);
    }
  });
  if (detail && prec == MatmulPrecision::kMedium && !syrk && batch == 1) {
    // The NS pieces one by one on the same buffers (bf16): Gram, A^2 with
    // a separate output, the X update with a separate output, normalise.
    const bool tall = s.rows > s.cols;
    void* ga2 = *b.Allocate(m * m * es);
    void* gx2 = *b.Allocate(m * n * es);
    Fill(b, ga2, m * m, gd);
    const MatrixView A = ContiguousView(ga, gd, m, m);
    const MatrixView B = ContiguousView(ga2, gd, m, m);
    const MatrixView X =
        tall ? ContiguousView(gx, gd, n, m) : ContiguousView(gx, gd, m, n);
    const MatrixView X2 =
        tall ? ContiguousView(gx2, gd, n, m) : ContiguousView(gx2, gd, m, n);
    const double t_gram = Seconds(b, reps, [&] {
      (void)b.Gemm(tall ? Op::kT : Op::kN, tall ? Op::kN : Op::kT, 1.0f, X, X,
                   0.0f, A, prec);
    });
    const double t_sq = Seconds(b, reps, [&] {
      (void)b.GemmOut(Op::kN, Op::kN, 2.0f, A, A, -4.0f, A, B, prec);
    });
    const double t_upd = Seconds(b, reps, [&] {
      if (tall) {
        (void)b.GemmOut(Op::kN, Op::kT, 1.0f, X, B, 3.0f, X, X2, prec);
      } else {
        (void)b.GemmOut(Op::kN, Op::kN, 1.0f, B, X, 3.0f, X, X2, prec);
      }
    });
    const double t_norm =
        Seconds(b, reps, [&] { (void)b.FrobeniusNormalize(vin, X, 1, 1e-7f); });
    const double t_conv = Seconds(b, reps, [&] { (void)b.Copy2D(vout, X); });
    const double f_mmn = 2.0 * m * m * n, f_mmm = 2.0 * m * m * m;
    std::printf(
        "| %s detail | %ldx%ld | gram %.3f ms (%.0f) | A^2 %.3f ms (%.0f) | "
        "update %.3f ms (%.0f) | normalize %.3f ms | to fp32 %.3f ms | 5x sum "
        "%.3f ms |\n",
        s.name.c_str(), long(s.rows), long(s.cols), t_gram * 1e3,
        f_mmn / t_gram / 1e12, t_sq * 1e3, f_mmm / t_sq / 1e12, t_upd * 1e3,
        f_mmn / t_upd / 1e12, t_norm * 1e3, t_conv * 1e3,
        (5 * (t_gram + t_sq + t_upd) + t_norm + t_conv) * 1e3);
    b.Free(ga2);
    b.Free(gx2);
  }
  const double ns_rate = batch * ns.FlopsPerMatrix() / t_ns;
  const double gemm_rate = batch * 2.0 * m * m * n / t_gemm;
  const double unit = b.is_device() ? 1e12 : 1e9;
  std::printf("| %s | %ldx%ld%s | %s | %.3f | %.2f | %.2f | %.3f |\n",
              s.name.c_str(), long(s.rows), long(s.cols),
              batch > 1 ? (" x" + std::to_string(batch)).c_str() : "",
              ModeName(mode).c_str(), t_ns * 1e3, ns_rate / unit,
              gemm_rate / unit, ns_rate / gemm_rate);
  std::fflush(stdout);
  for (void* p : {in, out, ga, gx, gc}) b.Free(p);
}

// Shapes of a named set (full, unsharded 2-D weights), or "RxC,RxC,...".
std::vector<Shape> ShapeSet(const std::string& set) {
  std::vector<Shape> list;
  if (set == "square" || set == "all") {
    for (int64_t d : {1024, 2048, 4096, 8192}) list.push_back({"square", d, d});
  }
  if (set == "llama" || set == "all") {
    list.push_back({"llama3-8b q/o_proj", 4096, 4096});
    list.push_back({"llama3-8b k/v_proj", 1024, 4096});
    list.push_back({"llama3-8b gate/up_proj", 14336, 4096});
    list.push_back({"llama3-8b down_proj", 4096, 14336});
  }
  if (set == "qwen") {
    list.push_back({"qwen3-1.7b q/o_proj", 2048, 2048});
    list.push_back({"qwen3-1.7b k/v_proj", 1024, 2048});
    list.push_back({"qwen3-1.7b gate/up_proj", 6144, 2048});
    list.push_back({"qwen3-1.7b down_proj", 2048, 6144});
  }
  if (set == "moe") {
    list.push_back({"qwen3-30b-a3b expert gate/up", 768, 2048});
    list.push_back({"qwen3-30b-a3b expert down", 2048, 768});
  }
  if (!list.empty()) return list;
  for (const std::string& tok :
       std::vector<std::string>(absl::StrSplit(set, ','))) {
    long r = 0, c = 0;
    if (std::sscanf(tok.c_str(), "%ldx%ld", &r, &c) == 2 && r > 0 && c > 0) {
      list.push_back({"custom", r, c});
    }
  }
  return list;
}

int Main(int argc, char** argv) {
  std::string backend_name = "cpu", shapes = "all", block_rows = "0";
  int reps = 5;
  int64_t batch = 1;
  bool detail = false;
  std::string precisions = "all";
  for (int i = 1; i < argc; ++i) {
    if (!std::strncmp(argv[i], "--backend=", 10)) backend_name = argv[i] + 10;
    if (!std::strncmp(argv[i], "--shapes=", 9)) shapes = argv[i] + 9;
    if (!std::strncmp(argv[i], "--reps=", 7)) reps = std::atoi(argv[i] + 7);
    if (!std::strcmp(argv[i], "--detail")) detail = true;
    if (!std::strncmp(argv[i], "--precisions=", 13)) precisions = argv[i] + 13;
    if (!std::strncmp(argv[i], "--batch=", 8)) batch = std::atoll(argv[i] + 8);
    if (!std::strncmp(argv[i], "--syrk_block_rows=", 18))
      block_rows = argv[i] + 18;
  }
  if (batch < 1) {
    std::fprintf(stderr, "ns_bench: --batch must be >= 1\n");
    return 2;
  }
  std::unique_ptr<Backend> b;
  std::vector<Shape> list;
  std::vector<Mode> modes;
  if (backend_name == "cpu") {
    b = MakeCpuBackend();
    list = {{"square", 256, 256},
            {"square", 512, 512},
            {"square", 1024, 1024},
            {"rect 1:4", 512, 2048},
            {"rect 4:1", 2048, 512}};
    modes = {{MatmulPrecision::kHighest, false, 0}};
  } else {
    auto c =
        MakeCudaBackend(0, CudaBackendOptionsFromLegacyEnvironment(
                               [](const char* n) { return std::getenv(n); }));
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", std::string(c.status().message()).c_str());
      return 1;
    }
    b = std::move(*c);
    list = ShapeSet(shapes);
    if (precisions != "medium") {
      modes = {{MatmulPrecision::kHighest, false, 0},
               {MatmulPrecision::kHigh, false, 0}};
    }
    modes.push_back({MatmulPrecision::kMedium, false, 0});
    for (const std::string& k :
         std::vector<std::string>(absl::StrSplit(block_rows, ','))) {
      modes.push_back({MatmulPrecision::kMedium, true, std::atoi(k.c_str())});
    }
  }
  const char* unit = b->is_device() ? "TFLOP/s" : "GFLOP/s";
  std::printf("backend %s, quintic, 5 steps, median of %d\n\n",
              std::string(b->name()).c_str(), reps);
  std::printf(
      "| shape | rows x cols | precision | NS ms | NS %s | GEMM %s | NS/GEMM "
      "|\n",
      unit, unit);
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Shape& s : list) {
    for (const Mode& mode : modes) Bench(*b, s, mode, reps, detail, batch);
  }
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) {
  muond::ReexecWithBetterOpenBlasCore(argv);  // the daemon's kernels
  return muond::Main(argc, argv);
}
