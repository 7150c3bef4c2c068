// Standalone correctness check and timing table for the sm_90a symmetric
// GEMM (core/backend/sym_gemm_sm90_kernel.cuh), all three consumer schedules:
// the Bazel binary //bench/gpu:sym_gemm_sm90_check (in the GPU bundle), or
// built with nvcc alone (bench/gpu/build_sym_gemm_check.sh). The Bazel
// targets //tests/core/backend:sym_gemm_cuda_test and
// //bench/gpu:sym_gemm_bench test the same kernel through the CUDA backend.
//
// Correctness: every d is compared with cuBLAS (cublasGemmStridedBatchedEx,
// fp32 accumulation, same inputs) within
//   |d - ref| <= 4 u |ref| + 2 k 2^-23 (|alpha| S + |beta| |c|) + tiny,
// u the output type's unit roundoff (bf16 2^-8, fp16 2^-11), S = |op(a)|
// |op(b)| (fp32 GEMM of absolute values): both sides round once from an fp32
// sum whose order differs, so each fp32 sum is within k 2^-23 S of the exact
// one (2^-23: the tensor cores' accumulation truncates) and the two roundings
// differ by at most a few ulp. d must equal d^T bitwise, and the padding
// columns (ld > n) must keep their sentinel. Every case runs with each consumer
// schedule (cooperative, ping-pong, wide); the ping-pong and wide schedules' d
// is also compared with the cooperative one's bitwise: for ping-pong a
// difference fails the case (the backend's auto rule lets the batch choose
// between the two for X X^T and X^T X without c), for wide it is reported
// (wide tiles issue a different GMMA shape, so equality is observed, not
// promised).
//
// Timing: the schedules against cuBLAS's full product (and that plus the
// mirror kernel, the backend's fallback), side by side per shape.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/gpu/power_sampler.h"
#include "core/backend/cuda_kernels.h"
#include "core/backend/sym_gemm_sm90.h"

namespace sg = muond::sym_gemm_sm90;

#define CK(x)                                                         \
  do {                                                                \
    cudaError_t e_ = (x);                                             \
    if (e_ != cudaSuccess) {                                          \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), \
                  __FILE__, __LINE__);                                \
      std::exit(2);                                                   \
    }                                                                 \
  } while (0)
#define CB(x)                                                                 \
  do {                                                                        \
    cublasStatus_t s_ = (x);                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                        \
      std::printf("cuBLAS error %d at %s:%d\n", int(s_), __FILE__, __LINE__); \
      std::exit(2);                                                           \
    }                                                                         \
  } while (0)

static cublasHandle_t g_cublas;
static int g_failures = 0;
// Per schedule: cases compared with the cooperative d, and bitwise equal.
static int g_vs_coop_cases[3] = {0, 0, 0}, g_vs_coop_same[3] = {0, 0, 0};

static uint16_t ToBits(float v, bool bf16) {
  if (bf16) {
    __nv_bfloat16 h = __float2bfloat16_rn(v);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  __half h = __float2half_rn(v);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
static float FromBits(uint16_t b, bool bf16) {
  if (bf16) {
    __nv_bfloat16 h;
    std::memcpy(&h, &b, 2);
    return __bfloat162float(h);
  }
  __half h;
  std::memcpy(&h, &b, 2);
  return __half2float(h);
}

static int64_t Up8(int64_t v) { return (v + 7) / 8 * 8; }

// Row-major d = alpha op(a) op(b) + beta c through cuBLAS (column-major: the
// transposed problem d^T = op(b)^T op(a)^T).
static void CublasRef(bool trans_a, bool trans_b, int64_t n, int64_t k,
                      float alpha, const void* a, int64_t lda, int64_t sa,
                      const void* b, int64_t ldb, int64_t sb, float beta,
                      void* d, int64_t ldd, int64_t sd, int64_t batch,
                      cudaDataType_t t, cublasComputeType_t ct) {
  CB(cublasGemmStridedBatchedEx(g_cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n),
                                int(n), int(k), &alpha, b, t, int(ldb), sb, a,
                                t, int(lda), sa, &beta, d, t, int(ldd), sd,
                                int(batch), ct, CUBLAS_GEMM_DEFAULT));
}

struct Case {
  bool bf16;
  bool trans_a;  // false: X X^T (N,T); true: X^T X (T,N)
  int64_t n, k, batch;
  float alpha, beta;
  int64_t extra_ld;  // padding beyond Up8(cols)
  sg::Schedule schedule;
  bool shared_c = false;  // one c for every slice (stride_c 0)
  // (N,N) of two distinct commuting symmetric n x n operands, X and
  // Y = X + I / 2 (k = n; trans_a unused): Gram NS's polynomial products
  // (Q Z + a Q, R Z + a R) take this form, B N-major.
  bool nn = false;
};

static const char* ScheduleName(sg::Schedule s) {
  switch (s) {
    case sg::Schedule::kPingpong:
      return "pingpong";
    case sg::Schedule::kWide:
      return "wide";
    case sg::Schedule::kCooperative:
      break;
  }
  return "cooperative";
}

// X symmetric n x n (row stride ld) per slice, and Y = X + I / 2: X's
// diagonal takes multiples of 1/64, so that adding 1/2 is exact in bf16 and
// fp16 and X Y = Y X holds exactly (the product is symmetric).
static void FillCommutingPair(int64_t n, int64_t ld, int64_t batch, bool bf,
                              std::mt19937* rng, std::vector<uint16_t>* x,
                              std::vector<uint16_t>* y) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int64_t s = ld * n;
  for (int64_t l = 0; l < batch; ++l)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        const float v = i == j ? std::round(u(*rng) * 64.f) / 64.f : u(*rng);
        const uint16_t b = ToBits(v, bf);
        (*x)[l * s + i * ld + j] = (*x)[l * s + j * ld + i] = b;
        (*y)[l * s + i * ld + j] = (*y)[l * s + j * ld + i] =
            i == j ? ToBits(FromBits(b, bf) + 0.5f, bf) : b;
      }
}

static void RunCase(const Case& cs) {
  const bool bf = cs.bf16;
  const int64_t n = cs.n, k = cs.nn ? cs.n : cs.k, batch = cs.batch;
  // X is n x k for (N,T), k x n for (T,N), a = b = X; for (N,N) a = X and
  // b = Y, both n x n.
  const int64_t xr = cs.trans_a ? k : n, xc = cs.trans_a ? n : k;
  const int64_t ldx = Up8(xc) + cs.extra_ld, sx = ldx * xr;
  const int64_t ldd = Up8(n) + cs.extra_ld, sd = ldd * n;
  std::mt19937 rng(uint32_t(n * 131 + k * 7 + batch + (bf ? 1 : 0) +
                            (cs.trans_a ? 3 : 0) + (cs.nn ? 5 : 0)));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint16_t> hx(sx * batch), hy, hc(sd * batch);
  if (cs.nn) {
    hy.resize(sx * batch);
    FillCommutingPair(n, ldx, batch, bf, &rng, &hx, &hy);
  } else {
    for (int64_t i = 0; i < sx * batch; ++i) hx[i] = ToBits(u(rng), bf);
  }
  auto abs_of = [bf](const std::vector<uint16_t>& h) {
    std::vector<float> a(h.size());
    for (size_t i = 0; i < h.size(); ++i) a[i] = std::fabs(FromBits(h[i], bf));
    return a;
  };
  // Symmetric c; with shared_c every slice is the first (the kernel reads
  // only that one, cuBLAS each slice's copy).
  for (int64_t l = 0; l < batch; ++l)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        if (cs.shared_c && l > 0) {
          hc[l * sd + i * ldd + j] = hc[i * ldd + j];
          hc[l * sd + j * ldd + i] = hc[j * ldd + i];
          continue;
        }
        const uint16_t v = ToBits(u(rng), bf);
        hc[l * sd + i * ldd + j] = hc[l * sd + j * ldd + i] = v;
      }
  const uint16_t sentinel = 0x7fc1;  // a NaN in both types
  void *dx, *dxa, *dc, *dd, *dref, *ds;
  CK(cudaMalloc(&dx, sx * batch * 2));
  CK(cudaMalloc(&dxa, sx * batch * 4));
  CK(cudaMalloc(&dc, sd * batch * 2));
  CK(cudaMalloc(&dd, sd * batch * 2));
  CK(cudaMalloc(&dref, sd * batch * 2));
  CK(cudaMalloc(&ds, sd * batch * 4));
  CK(cudaMemcpy(dx, hx.data(), sx * batch * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dxa, abs_of(hx).data(), sx * batch * 4,
                cudaMemcpyHostToDevice));
  // b = a = X but for (N,N), which alone has buffers of its own for Y.
  void *dy = dx, *dya = dxa;
  if (cs.nn) {
    CK(cudaMalloc(&dy, sx * batch * 2));
    CK(cudaMalloc(&dya, sx * batch * 4));
    CK(cudaMemcpy(dy, hy.data(), sx * batch * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dya, abs_of(hy).data(), sx * batch * 4,
                  cudaMemcpyHostToDevice));
  }
  CK(cudaMemcpy(dc, hc.data(), sd * batch * 2, cudaMemcpyHostToDevice));
  std::vector<uint16_t> fill(sd * batch, sentinel);
  CK(cudaMemcpy(dd, fill.data(), sd * batch * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dref, hc.data(), sd * batch * 2, cudaMemcpyHostToDevice));

  sg::Args a;
  a.elem = bf ? sg::Elem::kBFloat16 : sg::Elem::kFloat16;
  a.schedule = cs.schedule;
  a.trans_a = cs.nn ? false : cs.trans_a;
  a.trans_b = cs.nn ? false : !cs.trans_a;
  a.n = n;
  a.k = k;
  a.batch = batch;
  a.alpha = cs.alpha;
  a.beta = cs.beta;
  a.a = dx;
  a.b = dy;
  a.lda = a.ldb = ldx;
  a.stride_a = a.stride_b = sx;
  a.c = dc;
  a.ldc = ldd;
  a.stride_c = cs.shared_c ? 0 : sd;
  a.d = dd;
  a.ldd = ldd;
  a.stride_d = sd;
  const char* why = sg::Unsupported(a);
  if (why[0] != 0) {
    std::printf("FAIL unsupported: %s\n", why);
    ++g_failures;
    return;
  }
  CK(sg::Run(a, nullptr));
  CK(cudaDeviceSynchronize());
  if (cs.schedule != sg::Schedule::kCooperative) {
    sg::Args coop = a;
    coop.schedule = sg::Schedule::kCooperative;
    coop.d = ds;  // free until S below
    CK(cudaMemcpy(ds, fill.data(), sd * batch * 2, cudaMemcpyHostToDevice));
    CK(sg::Run(coop, nullptr));
    std::vector<uint16_t> hw(sd * batch), hcoop(sd * batch);
    CK(cudaMemcpy(hw.data(), dd, sd * batch * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hcoop.data(), ds, sd * batch * 2, cudaMemcpyDeviceToHost));
    ++g_vs_coop_cases[int(cs.schedule)];
    if (hw == hcoop) {
      ++g_vs_coop_same[int(cs.schedule)];
    } else if (cs.schedule == sg::Schedule::kPingpong) {
      // The backend's auto rule lets the batch choose between the two
      // (sym_gemm_rule.h PrefersPingpong).
      std::printf("FAIL pingpong d differs from cooperative d bitwise\n");
      ++g_failures;
    }
  }
  const cudaDataType_t t = bf ? CUDA_R_16BF : CUDA_R_16F;
  CublasRef(a.trans_a, a.trans_b, n, k, cs.alpha, dx, ldx, sx, dy, ldx, sx,
            cs.beta, dref, ldd, sd, batch, t, CUBLAS_COMPUTE_32F);
  const float one = 1.f, zero = 0.f;
  (void)one;
  // S = |op(a)| |op(b)| in fp32.
  CB(cublasGemmStridedBatchedEx(g_cublas, a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n),
                                int(n), int(k), &one, dya, CUDA_R_32F, int(ldx),
                                sx, dxa, CUDA_R_32F, int(ldx), sx, &zero, ds,
                                CUDA_R_32F, int(ldd), sd, int(batch),
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  CK(cudaDeviceSynchronize());
  std::vector<uint16_t> hd(sd * batch), hr(sd * batch);
  std::vector<float> hs(sd * batch);
  CK(cudaMemcpy(hd.data(), dd, sd * batch * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hr.data(), dref, sd * batch * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hs.data(), ds, sd * batch * 4, cudaMemcpyDeviceToHost));
  const double uu = bf ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  int64_t bad = 0, asym = 0, pad = 0, unwritten = 0;
  double worst = 0;  // max |d - ref| / tol
  for (int64_t l = 0; l < batch; ++l)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = n; j < ldd; ++j)
        if (hd[l * sd + i * ldd + j] != sentinel) ++pad;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t o = l * sd + i * ldd + j;
        if (hd[o] == sentinel) {
          ++unwritten;
          continue;
        }
        if (hd[o] != hd[l * sd + j * ldd + i]) ++asym;
        const double dv = FromBits(hd[o], bf), rv = FromBits(hr[o], bf);
        const double cv = std::fabs(FromBits(hc[o], bf));
        // Each side's fp32 sum is within k 2^-23 S of the exact one: the
        // tensor cores' fp32 accumulation truncates (Fasi et al., "Numerical
        // behavior of NVIDIA tensor cores", 2021), so a step's error is up
        // to 2^-23, twice round-to-nearest's.
        const double tol =
            4 * uu * std::fabs(rv) +
            2.0 * double(k) * std::ldexp(1.0, -23) *
                (std::fabs(cs.alpha) * hs[o] + std::fabs(cs.beta) * cv) +
            1e-30;
        const double e = std::fabs(dv - rv);
        if (!(e <= tol)) ++bad;
        if (e / tol > worst) worst = e / tol;
      }
    }
  const bool ok = bad == 0 && asym == 0 && pad == 0 && unwritten == 0;
  if (!ok) ++g_failures;
  std::printf(
      "| %s | %s | %s | %s | %lld | %lld | %lld | %.2f | %.2f | %lld | %.3f | "
      "%lld | %lld | %lld | %lld |\n",
      ok ? "ok" : "FAIL", ScheduleName(cs.schedule), bf ? "bf16" : "fp16",
      cs.nn        ? "XY (N,N)"
      : cs.trans_a ? "XtX (T,N)"
                   : "XXt (N,T)",
      (long long)n, (long long)k, (long long)batch, cs.alpha, cs.beta,
      (long long)ldd, worst, (long long)bad, (long long)asym, (long long)pad,
      (long long)unwritten);
  for (void* p : {dx, dxa, dc, dd, dref, ds}) cudaFree(p);
  if (cs.nn) {
    cudaFree(dy);
    cudaFree(dya);
  }
}

// ---------------------------------------------------------------------------
// Timing.

// Uniform values in [-1, 1) as bf16 bits, from a hash of the index: the
// timings need operands whose bits vary as real ones do. Constant operands
// (a memset) draw less power: an H100 ran this bench on them near its full
// clock, while the step's products ran at its 700 W limit, mostly at
// 1400-1700 MHz.
__global__ void FillUniformBf16(uint16_t* p, int64_t count, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float u = float(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(u));
  }
}
static void FillUniform(void* p, int64_t count, uint32_t seed) {
  FillUniformBf16<<<1024, 256>>>(static_cast<uint16_t*>(p), count, seed);
  CK(cudaGetLastError());
}

// Set in `time` mode with ITERS: the timings' power readings.
static muond::bench::PowerSampler* g_power = nullptr;

// With `power` (and g_power): the SM clock and board power sampled every
// 10 ms while the timed launches run, by a thread of its own: the host
// blocks in the launches once ~1k of them are queued, so sampling in this
// thread would see only the end of a long run. A sample counts once the
// start event has passed (the warm-up launches run before it).
static float TimeMs(int iters, const std::function<void()>& f,
                    muond::bench::PowerReading* power = nullptr) {
  cudaEvent_t s, e;
  CK(cudaEventCreate(&s));
  CK(cudaEventCreate(&e));
  std::atomic<bool> started{false}, stop{false};
  std::thread sampler;
  if (power != nullptr && g_power != nullptr) {
    sampler = std::thread([&] {
      while (!stop.load()) {
        // An event never recorded queries as done: wait for the record.
        if (started.load() && cudaEventQuery(s) == cudaSuccess &&
            cudaEventQuery(e) == cudaErrorNotReady) {
          g_power->Sample();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }
  // As many warm-up runs as timed ones: the clock settles under load.
  for (int i = 0; i < iters; ++i) f();
  // With power: the energy counter is read between host syncs, the warm-up's
  // end and the timed launches' end; the start event is recorded after the
  // first read, so the timing leaves the sync's gap out.
  double mj_start = -1;
  if (sampler.joinable()) {
    CK(cudaDeviceSynchronize());
    mj_start = g_power->EnergyMillijoules();
  }
  CK(cudaEventRecord(s));
  started.store(true);
  for (int i = 0; i < iters; ++i) f();
  CK(cudaEventRecord(e));
  CK(cudaEventSynchronize(e));
  if (sampler.joinable()) {
    const double mj_end = g_power->EnergyMillijoules();
    stop.store(true);
    sampler.join();
    *power = g_power->Take();
    power->mj_per_launch =
        muond::bench::PowerSampler::PerLaunch(mj_start, mj_end, iters);
  }
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, s, e));
  cudaEventDestroy(s);
  cudaEventDestroy(e);
  return ms / iters;
}

// TFLOP/s count the symmetric product's real work, n (n + 1) k per matrix
// (the lower triangle), for every column, so they compare as rates of the
// same job; cuBLAS's full product does twice that.
// `gram`: Gram NS's kind of product instead of X X^T: (N,N) of two
// symmetric n x n operands (k = n) plus 0.5 c, the epilogue reading c.
// tall: X^T X of a k x n X (T,N: Gram NS's R of a tall matrix), else X X^T
// of an n x k X; gram: (N,N) + 0.5 c with k = n.
static void PrintBenchHeader() {
  std::printf(
      "\n| product | n | k | batch | cooperative ms | TFLOP/s | pingpong ms | "
      "TFLOP/s | wide ms | TFLOP/s | cuBLAS full ms | TFLOP/s | full+mirror "
      "ms | cooperative / wide | full+mirror / cooperative | full+mirror / "
      "wide |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
      "---|\n");
}

// The power line under a timing row: per column the median SM clock while it
// ran, the energy a launch took (NVML's energy counter over the timed
// launches, else the median power x time) and the mean power it implies.
static void PrintPower(const muond::bench::PowerReading* pw,
                       const std::vector<float>& ms) {
  static const char* kColumns[] = {"cooperative", "pingpong", "wide",
                                   "cuBLAS full", "full+mirror"};
  if (g_power == nullptr) {
    std::printf(
        "power: NVML unavailable (libnvidia-ml.so.1 missing, or it found no "
        "device at this PCI bus id)\n");
    return;
  }
  std::printf("power:");
  for (int i = 0; i < 5; ++i) {
    // The counter's energy where NVML has it (to its ~10 ms refresh); else
    // the median power times the time (the power lags by ~1 s).
    const bool counted = pw[i].mj_per_launch >= 0;
    if (!counted && pw[i].samples == 0) {
      std::printf(" | %s: no samples", kColumns[i]);
      continue;
    }
    const double mj = counted ? pw[i].mj_per_launch : pw[i].watts * ms[i];
    std::printf(" | %s: ", kColumns[i]);
    if (pw[i].samples > 0)
      std::printf("%.0f MHz, ", pw[i].sm_mhz);
    else
      std::printf("clock n/a, ");
    std::printf("%.0f W, %.1f mJ a launch%s (%d samples)",
                counted ? mj / ms[i] : pw[i].watts, mj,
                counted ? " by the energy counter" : "", pw[i].samples);
  }
  std::printf("\n");
}

// iters_wanted: launches per timing (as many again to warm up); 0 picks by
// size.
static void Bench(int64_t n, int64_t k, int64_t batch, bool gram = false,
                  bool tall = false, int iters_wanted = 0) {
  const int64_t sx = n * k, sd = n * n, ldx = tall ? n : k;
  void *dx, *dd, *dc;
  CK(cudaMalloc(&dx, sx * batch * 2));
  CK(cudaMalloc(&dd, sd * batch * 2));
  CK(cudaMalloc(&dc, sd * batch * 2));
  // Random operands (FillUniform says why). The kernel's timing does not
  // depend on a square operand being symmetric.
  FillUniform(dx, sx * batch, 1);
  FillUniform(dc, sd * batch, 2);
  FillUniform(dd, sd * batch, 3);  // cuBLAS's c is its d
  const double flop = double(n) * (n + 1) * k * batch;
  const int iters = iters_wanted > 0
                        ? iters_wanted
                        : (flop > 5e11 ? 10 : (flop > 5e9 ? 30 : 100));
  sg::Args a;
  a.n = n;
  a.k = k;
  a.batch = batch;
  a.a = a.b = dx;
  a.lda = a.ldb = ldx;
  a.stride_a = a.stride_b = sx;
  a.d = dd;
  a.ldd = n;
  a.stride_d = sd;
  a.trans_a = tall;
  a.trans_b = !tall;
  const float beta = gram ? 0.5f : 0.0f;
  if (gram) {
    a.trans_b = false;
    a.beta = beta;
    a.c = dc;
    a.ldc = n;
    a.stride_c = sd;
  }
  auto kernel = [&](sg::Schedule s) {
    return [&a, s] {
      a.schedule = s;
      CK(sg::Run(a, nullptr));
    };
  };
  auto full = [&] {
    CublasRef(tall, !gram && !tall, n, k, 1.f, dx, ldx, sx, dx, ldx, sx, beta,
              dd, n, sd, batch, CUDA_R_16BF, CUBLAS_COMPUTE_32F);
  };
  muond::cuda_kernels::KView kd{dd, n, n, n, 2};
  auto full_sym = [&] {
    full();
    CK(muond::cuda_kernels::SymmetrizeFromLower(kd, sd, batch, nullptr));
  };
  // Power readings only for an explicit ITERS (a run long enough to reach
  // the power limit).
  muond::bench::PowerReading pw[5];
  const bool sampled = iters_wanted > 0;
  auto timed = [&](int column, const std::function<void()>& f) {
    return TimeMs(iters, f, sampled ? &pw[column] : nullptr);
  };
  const float tc = timed(0, kernel(sg::Schedule::kCooperative)),
              tp = timed(1, kernel(sg::Schedule::kPingpong)),
              tw = timed(2, kernel(sg::Schedule::kWide)), tf = timed(3, full),
              tfs = timed(4, full_sym);
  auto tflops = [&](float ms) { return flop / (ms * 1e-3) / 1e12; };
  std::printf(
      "| %s | %lld | %lld | %lld | %.4f | %.0f | %.4f | %.0f | %.4f | %.0f | "
      "%.4f | %.0f | %.4f | %.2f | %.2f | %.2f |\n",
      gram   ? "(N,N) + 0.5 c"
      : tall ? "X^T X"
             : "X X^T",
      (long long)n, (long long)k, (long long)batch, tc, tflops(tc), tp,
      tflops(tp), tw, tflops(tw), tf, tflops(tf), tfs, tc / tw, tfs / tc,
      tfs / tw);
  if (sampled) PrintPower(pw, {tc, tp, tw, tf, tfs});
  cudaFree(dx);
  cudaFree(dd);
  cudaFree(dc);
}

// The schedules whose correctness cases a mode runs: every one without a
// mode, or the one it names; none for any other word.
static std::vector<sg::Schedule> CaseSchedules(const std::string& mode) {
  if (mode.empty()) {
    return {sg::Schedule::kCooperative, sg::Schedule::kPingpong,
            sg::Schedule::kWide};
  }
  for (sg::Schedule sc : {sg::Schedule::kCooperative, sg::Schedule::kPingpong,
                          sg::Schedule::kWide}) {
    if (mode == ScheduleName(sc)) return {sc};
  }
  return {};
}

// A decimal count of 1..10^6 with nothing after it; -1 otherwise.
static int64_t ParseCount(const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != 0 || errno != 0 || v < 1 || v > 1000000) {
    return -1;
  }
  return v;
}

int main(int argc, char** argv) {
  // "bench": the timings only; "wide", "cooperative" or "pingpong": that
  // schedule's cases only;
  // "time N K BATCH [xxt|gram|tall [ITERS]]": one timing row (e.g. under a
  // profiler); ITERS launches per column (and as many to warm up), so that a
  // run can last long enough for the clocks to settle under sustained load.
  // The arguments are checked before any CUDA call, so that the usage shows
  // on a machine without a GPU too.
  const std::string mode = argc > 1 ? argv[1] : "";
  const char* usage =
      "usage: sym_gemm_sm90_check [bench | wide | cooperative | pingpong | "
      "time N K "
      "BATCH [xxt|gram|tall [ITERS]]]\n";
  const std::string kind = argc > 5 ? argv[5] : "";
  const int64_t tn = argc > 2 ? ParseCount(argv[2]) : 0,
                tk = argc > 3 ? ParseCount(argv[3]) : 0,
                tb = argc > 4 ? ParseCount(argv[4]) : 0;
  const int64_t iters = argc > 6 ? ParseCount(argv[6]) : 0;
  const bool gram = kind == "gram", tall = kind == "tall";
  if (mode == "time") {
    // Bench's operands: contiguous n x k (k x n tall), n x n for gram.
    if (tn < 1 || tk < 1 || tb < 1 || tn % 8 || tk % 8 ||
        (kind != "" && kind != "xxt" && !gram && !tall) || (gram && tk != tn) ||
        argc > 7 || (argc > 6 && iters < 1)) {
      std::printf(
          "%stime: N, K, BATCH and ITERS whole numbers 1..1000000, N and K "
          "multiples of 8, K = N for gram; the kind (xxt, gram or tall) "
          "before ITERS\n",
          usage);
      return 2;
    }
  } else if (mode != "bench" && CaseSchedules(mode).empty()) {
    std::printf("%s", usage);
    return 2;
  }
  int dev = 0, devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf(
        "sym_gemm_sm90_check: no CUDA device here (it needs an sm_90 "
        "GPU)\n");
    return 2;
  }
  CK(cudaSetDevice(dev));
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, dev));
  std::printf("device: %s (sm_%d%d, %d SMs); kernel supported: %d\n", p.name,
              p.major, p.minor, p.multiProcessorCount,
              int(sg::DeviceSupported(dev)));
  CB(cublasCreate(&g_cublas));
  if (mode == "time") {
    char pci[32] = {0};
    CK(cudaDeviceGetPCIBusId(pci, sizeof(pci), dev));
    static muond::bench::PowerSampler sampler(pci);
    if (sampler.Available()) g_power = &sampler;
    PrintBenchHeader();
    Bench(tn, tk, tb, gram, tall, int(iters));
    return 0;
  }
  if (mode != "bench") {
    std::printf(
        "\n| ok | schedule | dtype | orientation | n | k | batch | alpha | "
        "beta | ld | max err/tol | bad | asym | pad | unwritten |\n|---|---|"
        "---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<Case> cases;
    for (sg::Schedule sc : CaseSchedules(mode))
      for (bool bf : {true, false})
        for (bool ta : {false, true})
          for (int64_t n0 : {1, 7, 130, 300, 1000, 1300, 4096}) {
            // The kernel's operands: the contiguous extent (k of X X^T, n
            // of X^T X) a multiple of 8; the other any size, so that c's
            // and d's last chunks and tiles are partial.
            auto fit = [&](int64_t v) { return v % 8 == 0 ? v : Up8(v); };
            const int64_t n = ta ? fit(n0) : n0;
            auto kk = [&](int64_t v) { return ta ? v : fit(v); };
            for (int64_t k : {kk(n), kk((n * 7 + 1) / 2)}) {
              cases.push_back({bf, ta, n, k, 1, 1.f, 0.f, 0, sc});
            }
            cases.push_back({bf, ta, n, kk(n), 1, 0.7f, -0.3f, 8, sc});
            if (n <= 1000)
              cases.push_back({bf, ta, n, kk(3 * n + 5), 3, 1.f, 0.5f, 0, sc});
            // A CTA's next tile in the next batch slice, the c it prefetches
            // ending in partial 16-byte chunks (n = 1003) or shared by every
            // slice (stride_c 0).
            if (n0 == 1000) {
              const int64_t m = ta ? n : n + 3;
              cases.push_back({bf, ta, m, kk(n), 12, 0.7f, -0.3f, 0, sc});
              cases.push_back(
                  {bf, ta, n, kk(n), 12, 1.f, 0.5f, 0, sc, /*shared_c=*/true});
            }
          }
    // (N,N) + c of commuting operands, as Gram NS's polynomial runs them
    // (the sizes where auto takes ping-pong with c, and smaller ones).
    for (sg::Schedule sc : CaseSchedules(mode))
      for (bool bf : {true, false})
        for (int64_t n : {136, 1000, 2048, 4096}) {
          Case c{bf, false, n, n, n >= 2048 ? 2 : 3, 1.f, 0.5f, 0, sc};
          c.nn = true;
          cases.push_back(c);
        }
    for (const Case& c : cases) RunCase(c);
    std::printf("\ncorrectness: %d failing case(s) of %zu\n", g_failures,
                cases.size());
    for (sg::Schedule sc : {sg::Schedule::kPingpong, sg::Schedule::kWide}) {
      const int i = int(sc);
      if (g_vs_coop_cases[i] == 0) continue;
      std::printf("%s vs cooperative: %d of %d cases bitwise equal\n",
                  ScheduleName(sc), g_vs_coop_same[i], g_vs_coop_cases[i]);
    }
  }
  PrintBenchHeader();
  for (int64_t n : {256, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192})
    for (int64_t k : {n, n * 7 / 2}) Bench(n, k, 1);
  // Batches: standard NS's X X^T of expert-sized matrices, and Gram NS's
  // m x m products with c (k = m) of a MoE layer's experts (m = 768) and of
  // dense layers (m = 1024..4096).
  for (int64_t n : {128, 256, 512, 1024})
    for (int64_t b : {8, 32}) Bench(n, n * 7 / 2 / 8 * 8, b);
  for (int64_t n : {512, 768, 1024, 2048, 4096})
    for (int64_t b : {1, 4, 16, 64, 256}) {
      const int64_t elems = n * n * b;
      if (elems >= (int64_t(1) << 22) && elems <= (int64_t(1) << 28)) {
        Bench(n, n, b, /*gram=*/true);
      }
    }
  // Gram NS's R of a MoE layer's experts (Qwen3-30B-A3B: 768 x 2048 gate
  // and up, X X^T, batch 256; 2048 x 768 down, X^T X, batch 128), which the
  // backend's rule (UseSymGemmKernel) sent to cuBLAS's full product while
  // it took the kernel only for k <= 2 n below n = 1536.
  Bench(768, 2048, 256);
  Bench(768, 2048, 128, /*gram=*/false, /*tall=*/true);
  // The rule's edge below n = 1536: single and small-batch products at
  // k = 2..3 n, both orientations.
  for (int64_t n : {512, 768, 1024})
    for (int64_t k : {2 * n, n * 5 / 2, n * 8 / 3 / 8 * 8, 3 * n})
      for (int64_t b : {1, 8}) {
        Bench(n, k, b);
        Bench(n, k, b, /*gram=*/false, /*tall=*/true);
      }
  // Ping-pong's edges in the backend's auto rule (sym_gemm_rule.h
  // PrefersPingpong: two waves of lower tiles for X X^T and X^T X without
  // c, and products with c from n = 2048 at any batch): batches of 100 to 350
  // lower tiles around the first (shapes the backend sends to the kernel: k <=
  // 3 n below n = 1536), the second's sides (n = 2048 with c alone, 136 tiles,
  // and at batch 2; n = 1536 with c), and the dense step sets' batched X X^T
  // (Llama-3-8B's R of 4096 x 14336 at batch 12, Qwen3-1.7B's 2048 x 6144 at
  // batch 56 and 1024 x 2048 at batch 56).
  for (int64_t b : {4, 6, 8}) Bench(1024, 3072, b);   // 36 tiles a product
  for (int64_t b : {2, 3, 4}) Bench(1536, 5376, b);   // 78
  for (int64_t b : {6, 12, 16}) Bench(768, 2048, b);  // 21
  for (int64_t b : {1, 2}) Bench(2048, 2048, b, /*gram=*/true);  // 136
  Bench(1536, 1536, 8, /*gram=*/true);                           // 78
  Bench(4096, 14336, 12);
  Bench(2048, 6144, 56);
  Bench(1024, 2048, 56);
  return g_failures == 0 ? 0 : 1;
}
