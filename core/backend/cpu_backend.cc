#include "core/backend/cpu_backend.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/backend/bf16.h"
#include "core/backend/elementwise_math.h"
#include "core/backend/fp16.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

char* ElemPtr(const MatrixView& v, int64_t i, int64_t j) {
  return static_cast<char*>(v.data) +
         (i * v.row_stride + j) * int64_t(DTypeSize(v.dtype));
}

float Load(const MatrixView& v, int64_t i, int64_t j) {
  const char* p = ElemPtr(v, i, j);
  if (v.dtype == DType::kFloat32) return *reinterpret_cast<const float*>(p);
  const uint16_t bits = *reinterpret_cast<const uint16_t*>(p);
  return v.dtype == DType::kFloat16 ? Fp16BitsToFloat(bits)
                                    : Bf16BitsToFloat(bits);
}

void Store(const MatrixView& v, int64_t i, int64_t j, float x) {
  char* p = ElemPtr(v, i, j);
  if (v.dtype == DType::kFloat32) {
    *reinterpret_cast<float*>(p) = x;
  } else if (v.dtype == DType::kFloat16) {
    *reinterpret_cast<uint16_t*>(p) = FloatToFp16Bits(x);
  } else {
    *reinterpret_cast<uint16_t*>(p) = FloatToBf16Bits(x);
  }
}

// Row r's sum of squares, left to right in fp64, rounded once.
float RowSumSquares(const MatrixView& x, int64_t r) {
  double sum = 0.0;
  for (int64_t j = 0; j < x.cols; ++j) {
    const double v = Load(x, r, j);
    sum += v * v;
  }
  return static_cast<float>(sum);
}

template <typename F>
void ForEach(const MatrixView& shape, F&& f) {
  for (int64_t i = 0; i < shape.rows; ++i) {
    for (int64_t j = 0; j < shape.cols; ++j) f(i, j);
  }
}

MatrixView Slice(const MatrixView& v, int64_t stride, int64_t i) {
  MatrixView s = v;
  s.data =
      static_cast<char*>(v.data) + i * stride * int64_t(DTypeSize(v.dtype));
  return s;
}

// One row of each 16-bit conversion, compiled for AVX-512 and AVX2 besides
// the baseline (GCC's target_clones: the loader picks the CPU's) so the
// loops vectorise: they run on every operand and result of every kMedium NS
// product. Integer bit operations and exact conversions, so every clone
// gives the same bits as the others (and -ffp-contract=off in BUILD keeps
// a multiply from fusing into an FMA on the wider targets).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MUOND_ROW_CLONES \
  __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MUOND_ROW_CLONES
#endif

MUOND_ROW_CLONES void Bf16RowToFloat(float* out, const uint16_t* in,
                                     int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = Bf16BitsToFloat(in[j]);
}

MUOND_ROW_CLONES void FloatRowToBf16(uint16_t* out, const float* in,
                                     int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = FloatToBf16Bits(in[j]);
}

MUOND_ROW_CLONES void Fp16RowToFloat(float* out, const uint16_t* in,
                                     int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = Fp16BitsToFloat(in[j]);
}

MUOND_ROW_CLONES void FloatRowToFp16(uint16_t* out, const float* in,
                                     int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = FloatToFp16Bits(in[j]);
}

template <typename To, typename From>
void ConvertRows(const MatrixView& dst, const MatrixView& src,
                 void (*convert_row)(To*, const From*, int64_t)) {
  for (int64_t i = 0; i < src.rows; ++i) {
    convert_row(static_cast<To*>(dst.data) + i * dst.row_stride,
                static_cast<const From*>(src.data) + i * src.row_stride,
                src.cols);
  }
}

// dst <- src elementwise for same-shape views (fp32 -> bf16/fp16 rounds to
// nearest even, bf16/fp16 -> fp32 is exact; bf16 <-> fp16 goes through fp32,
// so it is rounded once).
void ConvertInto(const MatrixView& dst, const MatrixView& src) {
  // The 16-bit GEMMs' conversions (kMedium: every operand and result of
  // every NS product) as plain row loops: through Load/Store, a dtype switch
  // per element, they cost ten times the fp32 GEMM of a small matrix.
  const DType to = dst.dtype, from = src.dtype;
  if (to == DType::kFloat32 && from == DType::kBFloat16) {
    return ConvertRows(dst, src, Bf16RowToFloat);
  }
  if (to == DType::kBFloat16 && from == DType::kFloat32) {
    return ConvertRows(dst, src, FloatRowToBf16);
  }
  if (to == DType::kFloat32 && from == DType::kFloat16) {
    return ConvertRows(dst, src, Fp16RowToFloat);
  }
  if (to == DType::kFloat16 && from == DType::kFloat32) {
    return ConvertRows(dst, src, FloatRowToFp16);
  }
  // Other pairs (none of the 16-bit GEMMs'): element by element.
  ForEach(src,
          [&](int64_t i, int64_t j) { Store(dst, i, j, Load(src, i, j)); });
}

// Per-thread fp32 rows for the elementwise kernels below (lanes run on
// worker threads), kept across calls: a step allocates none per param.
struct RowScratch {
  std::vector<float> in[2], out[2];
};

RowScratch& ThreadRowScratch() {
  thread_local RowScratch scratch;
  return scratch;
}

// `row` resized to n floats (not cleared).
float* RowOfSize(std::vector<float>& row, int64_t n) {
  row.resize(size_t(n));
  return row.data();
}

// Row i of v alone (one row, v's dtype).
MatrixView RowOf(const MatrixView& v, int64_t i) {
  return MatrixView{ElemPtr(v, i, 0), v.dtype, 1, v.cols, v.cols};
}

// Row i of v as fp32: v's own memory where v is fp32, else the row widened
// into `buf` (exact). The elementwise kernels below run on such rows, so
// their loops are plain fp32 loops instead of a dtype switch per element.
const float* FloatRow(const MatrixView& v, int64_t i, std::vector<float>& buf) {
  if (v.dtype == DType::kFloat32) {
    return static_cast<const float*>(v.data) + i * v.row_stride;
  }
  buf.resize(size_t(v.cols));
  ConvertInto(ContiguousView(buf.data(), DType::kFloat32, 1, v.cols),
              RowOf(v, i));
  return buf.data();
}

// `row` (v.cols fp32 values) as row i of v, rounded to v's dtype as Store
// rounds.
void StoreFloatRow(const MatrixView& v, int64_t i, const float* row) {
  if (v.dtype == DType::kFloat32) {
    std::memmove(ElemPtr(v, i, 0), row, size_t(v.cols) * sizeof(float));
    return;
  }
  ConvertInto(RowOf(v, i), ContiguousView(const_cast<float*>(row),
                                          DType::kFloat32, 1, v.cols));
}

int Ld(const MatrixView& v) {
  return int(std::max<int64_t>(v.row_stride, v.cols));
}

// c <- alpha * op(a) op(b) + beta * c for one fp32 problem (views checked).
// beta == 0 never reads c: BLAS overwrites c then, and so does the k == 0
// branch.
void SgemmSlice(Op op_a, Op op_b, float alpha, const MatrixView& a,
                const MatrixView& b, float beta, const MatrixView& c) {
  const int64_t m = c.rows, n = c.cols;
  const int64_t k = op_a == Op::kN ? a.cols : a.rows;
  if (m == 0 || n == 0) return;
  if (k == 0) {  // BLAS leaves c untouched only when beta == 1.
    ForEach(c, [&](int64_t r, int64_t s) {
      Store(c, r, s, beta == 0.0f ? 0.0f : beta * Load(c, r, s));
    });
    return;
  }
  cblas_sgemm(CblasRowMajor, op_a == Op::kN ? CblasNoTrans : CblasTrans,
              op_b == Op::kN ? CblasNoTrans : CblasTrans, int(m), int(n),
              int(k), alpha, static_cast<const float*>(a.data), Ld(a),
              static_cast<const float*>(b.data), Ld(b), beta,
              static_cast<float*>(c.data), Ld(c));
}

// The same elements in the same layout.
bool SameView(const MatrixView& x, const MatrixView& y) {
  return x.data == y.data && x.dtype == y.dtype && x.rows == y.rows &&
         x.cols == y.cols && x.row_stride == y.row_stride;
}

// fp32 scratch for the bf16/fp16 (kMedium) GEMM, reused across batch slices.
struct Fp32Scratch {
  std::vector<float> a, b, c;
};

// A contiguous fp32 view of v's shape over `buf` (resized, not cleared).
MatrixView Fp32Like(std::vector<float>& buf, const MatrixView& v) {
  buf.resize(size_t(v.numel()));
  return ContiguousView(buf.data(), DType::kFloat32, v.rows, v.cols);
}

// kMedium on bf16 or fp16 views, with the semantics of cuBLASLt's 16-bit
// GEMMs with CUBLAS_COMPUTE_32F: the operands are widened to fp32 (exact), so
// every product of two bf16 (8 significant bits) or fp16 (11) values is exact
// in fp32 and the sum is accumulated in fp32 by the fp32 path; alpha and beta
// apply in fp32 (beta * c from the 16-bit c), and the result is rounded to
// the view's dtype once.
void Gemm16Slice(Op op_a, Op op_b, float alpha, const MatrixView& a,
                 const MatrixView& b, float beta, const MatrixView& c,
                 Fp32Scratch& scratch) {
  const MatrixView a32 = Fp32Like(scratch.a, a), c32 = Fp32Like(scratch.c, c);
  ConvertInto(a32, a);
  // X Xᵀ, R R (Newton–Schulz's Gram and square products) widen one operand.
  const bool b_is_a = SameView(b, a);
  const MatrixView b32 = b_is_a ? a32 : Fp32Like(scratch.b, b);
  if (!b_is_a) ConvertInto(b32, b);
  if (beta != 0.0f) {  // beta == 0 never reads c
    // c is often an operand too (Q <- Q Z + a Q): copy its widened values.
    if (SameView(c, a) || SameView(c, b)) {
      std::memcpy(c32.data, SameView(c, a) ? a32.data : b32.data,
                  size_t(c.numel()) * sizeof(float));
    } else {
      ConvertInto(c32, c);
    }
  }
  SgemmSlice(op_a, op_b, alpha, a32, b32, beta, c32);
  ConvertInto(c, c32);
}

// MemAvailable and MemTotal of /proc/meminfo (kB), else sysconf's free and
// physical pages.
MemoryInfo HostMemory() {
  MemoryInfo info;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (meminfo >> key >> kb) {
    std::getline(meminfo, unit);
    if (key == "MemAvailable:") info.free_bytes = kb * 1024;
    if (key == "MemTotal:") info.total_bytes = kb * 1024;
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (info.total_bytes == 0) info.total_bytes = sysconf(_SC_PHYS_PAGES) * page;
  if (info.free_bytes == 0) info.free_bytes = sysconf(_SC_AVPHYS_PAGES) * page;
  return info;
}

// MuonMomentum on fp8 state, block by block of kStateBlock consecutive
// elements (element e at row e / cols, column e % cols of grad and out, which
// may be strided): dequantize, the fp32 EMA, `out` from the unquantized new
// value, then the block's absmax, scale and codes. Every code and the scale
// of a block are read before any is written (in place).
void MomentumFp8(const MatrixView& grad, const MatrixView& momentum_in,
                 const MatrixView& momentum_out, float w_ema, float w_nesterov,
                 bool nesterov, const MatrixView& out,
                 const BlockScales& scales) {
  const uint8_t* codes_in = static_cast<const uint8_t*>(momentum_in.data);
  uint8_t* codes_out = static_cast<uint8_t*>(momentum_out.data);
  const int64_t n = grad.numel();
  float block[kStateBlock];
  for (int64_t b0 = 0, b = 0; b0 < n; b0 += kStateBlock, ++b) {
    const int64_t len = std::min(kStateBlock, n - b0);
    const float scale_in = scales.in[b];
    float absmax = 0.0f;
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = (b0 + k) / grad.cols, j = (b0 + k) % grad.cols;
      const float g = Load(grad, i, j);
      const float m = ew::DequantizeE4M3(codes_in[b0 + k], scale_in);
      block[k] = ew::MomentumEma(m, g, w_ema);
      if (!IsAbsent(out)) {
        Store(out, i, j,
              nesterov ? ew::NesterovInput(g, block[k], w_nesterov) : block[k]);
      }
      absmax = ew::AbsMaxStep(absmax, block[k]);
    }
    if (codes_out == nullptr) continue;  // momentum_out absent
    const float scale = ew::BlockScale(absmax);
    for (int64_t k = 0; k < len; ++k) {
      codes_out[b0 + k] = ew::QuantizeE4M3(block[k], scale);
    }
    scales.out[b] = scale;
  }
}

// AdamW on fp8 moments, block by block as MomentumFp8: both moments
// dequantized, the fp32 step (the param from the unquantized new moments),
// then each moment's block absmax, scale and codes; exp_avg_sq's codes hold
// its square root (ew::SecondMomentRoot).
void AdamWFp8(const MatrixView& param, const MatrixView& grad,
              const MatrixView& exp_avg, const MatrixView& exp_avg_sq,
              const AdamWScalars& s, const AdamWMomentScales& scales) {
  uint8_t* m_codes = static_cast<uint8_t*>(exp_avg.data);
  uint8_t* v_codes = static_cast<uint8_t*>(exp_avg_sq.data);
  const int64_t n = param.numel();
  float m_block[kStateBlock], v_root_block[kStateBlock];
  for (int64_t b0 = 0, b = 0; b0 < n; b0 += kStateBlock, ++b) {
    const int64_t len = std::min(kStateBlock, n - b0);
    float m_absmax = 0.0f, v_root_absmax = 0.0f;
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = (b0 + k) / param.cols, j = (b0 + k) % param.cols;
      const ew::AdamWOut o = ew::AdamWElement(
          Load(param, i, j), Load(grad, i, j),
          ew::DequantizeE4M3(m_codes[b0 + k], scales.exp_avg[b]),
          ew::DequantizeSecondMoment(v_codes[b0 + k], scales.exp_avg_sq[b]),
          s.param_decay, s.one_minus_beta1, s.beta2, s.one_minus_beta2,
          s.step_size, s.bias_correction2_sqrt, s.eps);
      Store(param, i, j, o.p);
      m_block[k] = o.m;
      v_root_block[k] = ew::SecondMomentRoot(o.v);
      m_absmax = ew::AbsMaxStep(m_absmax, o.m);
      v_root_absmax = ew::AbsMaxStep(v_root_absmax, v_root_block[k]);
    }
    const float m_scale = ew::BlockScale(m_absmax);
    const float v_scale = ew::BlockScale(v_root_absmax);
    for (int64_t k = 0; k < len; ++k) {
      m_codes[b0 + k] = ew::QuantizeE4M3(m_block[k], m_scale);
      v_codes[b0 + k] = ew::QuantizeSecondMomentRoot(v_root_block[k], v_scale);
    }
    scales.exp_avg[b] = m_scale;
    scales.exp_avg_sq[b] = v_scale;
  }
}

class CpuBackend final : public Backend {
 public:
  std::string_view name() const override { return "cpu"; }
  bool is_device() const override { return false; }
  // kHigh (TF32 products) has no CPU counterpart: CPUs have no TF32 unit,
  // and emulating it would match neither cuBLAS's TF32 kernels nor fp32, so
  // it stays an error rather than a silent switch to kHighest.
  bool SupportsPrecision(MatmulPrecision p) const override {
    return p == MatmulPrecision::kHighest || p == MatmulPrecision::kMedium;
  }

  absl::StatusOr<MemoryInfo> Memory() override { return HostMemory(); }

  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("allocate: bytes must be >= 0, got ", bytes));
    }
    const size_t rounded = (size_t(bytes) + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, rounded == 0 ? 256 : rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("allocate: out of host memory for ", bytes, " bytes"));
    }
    return p;
  }
  void Free(void* ptr) override { std::free(ptr); }

  absl::Status Memset0(const MatrixView& v) override {
    RETURN_IF_ERROR(CheckView(v, "memset0"));
    const size_t row_bytes = size_t(v.cols) * DTypeSize(v.dtype);
    for (int64_t i = 0; i < v.rows; ++i)
      std::memset(ElemPtr(v, i, 0), 0, row_bytes);
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(void* dst, const void* src,
                            int64_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, size_t(bytes));
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, int64_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, size_t(bytes));
    return absl::OkStatus();
  }
  absl::Status Copy2D(const MatrixView& dst, const MatrixView& src) override {
    RETURN_IF_ERROR(CheckCopy(dst, src));
    if (dst.data == src.data && dst.dtype == src.dtype &&
        dst.row_stride == src.row_stride) {
      return absl::OkStatus();
    }
    if (dst.dtype == src.dtype) {
      const size_t row_bytes = size_t(src.cols) * DTypeSize(src.dtype);
      for (int64_t i = 0; i < src.rows; ++i) {
        std::memmove(ElemPtr(dst, i, 0), ElemPtr(src, i, 0), row_bytes);
      }
      return absl::OkStatus();
    }
    ConvertInto(dst, src);
    return absl::OkStatus();
  }

  absl::Status Gemm(Op op_a, Op op_b, float alpha, const MatrixView& a,
                    const MatrixView& b, float beta, const MatrixView& c,
                    MatmulPrecision precision) override {
    return GemmStridedBatched(op_a, op_b, alpha, a, 0, b, 0, beta, c, 0, 1,
                              precision);
  }

  absl::Status GemmStridedBatched(Op op_a, Op op_b, float alpha,
                                  const MatrixView& a, int64_t stride_a,
                                  const MatrixView& b, int64_t stride_b,
                                  float beta, const MatrixView& c,
                                  int64_t stride_c, int64_t batch,
                                  MatmulPrecision precision) override {
    RETURN_IF_ERROR(CheckPrecision(precision));
    RETURN_IF_ERROR(CheckGemm(op_a, op_b, a, b, c, precision));
    if (batch < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemm: batch must be >= 0, got ", batch));
    }
    Fp32Scratch scratch;
    for (int64_t i = 0; i < batch; ++i) {
      const MatrixView ai = Slice(a, stride_a, i), bi = Slice(b, stride_b, i),
                       ci = Slice(c, stride_c, i);
      if (precision == MatmulPrecision::kMedium) {
        Gemm16Slice(op_a, op_b, alpha, ai, bi, beta, ci, scratch);
      } else {
        SgemmSlice(op_a, op_b, alpha, ai, bi, beta, ci);
      }
    }
    return absl::OkStatus();
  }

  absl::Status AddToDiagonal(const MatrixView& view, int64_t stride,
                             int64_t batch, float value) override {
    RETURN_IF_ERROR(CheckAddToDiagonal(view, batch));
    for (int64_t s = 0; s < batch; ++s) {
      const MatrixView v = Slice(view, stride, s);
      for (int64_t i = 0; i < v.rows; ++i)
        Store(v, i, i, Load(v, i, i) + value);
    }
    return absl::OkStatus();
  }

  absl::Status SymmetrizeFromLower(const MatrixView& a, int64_t stride,
                                   int64_t batch) override {
    RETURN_IF_ERROR(CheckView(a, "symmetrize"));
    if (a.rows != a.cols) {
      return absl::InvalidArgumentError(absl::StrCat(
          "symmetrize: slices must be square, got ", a.rows, "x", a.cols));
    }
    const size_t es = DTypeSize(a.dtype);
    for (int64_t s = 0; s < batch; ++s) {
      const MatrixView v = Slice(a, stride, s);
      for (int64_t i = 0; i < v.rows; ++i) {
        for (int64_t j = i + 1; j < v.cols; ++j) {
          std::memcpy(ElemPtr(v, i, j), ElemPtr(v, j, i), es);
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status FrobeniusNormalize(const MatrixView& src, const MatrixView& dst,
                                  int64_t batch, float eps) override {
    RETURN_IF_ERROR(CheckNormalize(src, dst, batch, eps));
    const int64_t r = src.rows / batch;
    RowScratch& rows = ThreadRowScratch();
    std::vector<float>& in = rows.in[0];
    float* out = RowOfSize(rows.out[0], src.cols);
    for (int64_t s = 0; s < batch; ++s) {
      double sum = 0.0;  // in order, element by element, as before
      for (int64_t i = s * r; i < (s + 1) * r; ++i) {
        const float* x = FloatRow(src, i, in);
        for (int64_t j = 0; j < src.cols; ++j) {
          sum += double(x[j]) * double(x[j]);
        }
      }
      const float norm = static_cast<float>(std::sqrt(sum));
      const float denom = std::max(norm, eps);
      for (int64_t i = s * r; i < (s + 1) * r; ++i) {
        const float* x = FloatRow(src, i, in);
        for (int64_t j = 0; j < src.cols; ++j) out[j] = x[j] / denom;
        StoreFloatRow(dst, i, out);
      }
    }
    return absl::OkStatus();
  }

  using Backend::MuonMomentum;
  absl::Status MuonMomentum(const MatrixView& grad,
                            const MatrixView& momentum_in,
                            const MatrixView& momentum_out, double beta,
                            bool nesterov, const MatrixView& out,
                            const BlockScales& scales) override {
    RETURN_IF_ERROR(
        CheckMomentum(grad, momentum_in, momentum_out, out, scales));
    const float w_ema = static_cast<float>(1.0 - beta);
    const float w_nesterov = static_cast<float>(beta);
    if (momentum_in.dtype == DType::kFloat8E4M3) {
      MomentumFp8(grad, momentum_in, momentum_out, w_ema, w_nesterov, nesterov,
                  out, scales);
      return absl::OkStatus();
    }
    const bool store_momentum = !IsAbsent(momentum_out);
    const bool store_out = !IsAbsent(out);
    const bool bf16_state = momentum_in.dtype == DType::kBFloat16;
    const size_t cols = size_t(grad.cols);
    RowScratch& rows = ThreadRowScratch();
    float* m_new = RowOfSize(rows.out[0], grad.cols);
    float* ns_in = RowOfSize(rows.out[1], grad.cols);
    for (int64_t i = 0; i < grad.rows; ++i) {
      const float* g = FloatRow(grad, i, rows.in[0]);
      const float* m_in = FloatRow(momentum_in, i, rows.in[1]);
      for (size_t j = 0; j < cols; ++j) {
        m_new[j] = ew::MomentumEma(m_in[j], g[j], w_ema);
        // With bf16 state the NS input sees the stored (rounded) momentum.
        const float m = bf16_state ? RoundToBf16(m_new[j]) : m_new[j];
        ns_in[j] = nesterov ? ew::NesterovInput(g[j], m, w_nesterov) : m;
      }
      // Stored after the row is read: momentum_out may be momentum_in.
      if (store_momentum) StoreFloatRow(momentum_out, i, m_new);
      if (store_out) StoreFloatRow(out, i, ns_in);
    }
    return absl::OkStatus();
  }

  absl::Status ApplyRowScaledUpdateBatch(
      absl::Span<const MatrixView> params, absl::Span<const MatrixView> updates,
      absl::Span<const MatrixView> row_factors, absl::Span<const float> lrs,
      float decay, WeightDecayMethod method) override {
    RETURN_IF_ERROR(
        CheckRowScaledUpdateBatch(params, updates, row_factors, lrs));
    const int m = static_cast<int>(method);
    for (size_t k = 0; k < params.size(); ++k) {
      const MatrixView &p = params[k], &u = updates[k], &f = row_factors[k];
      ForEach(p, [&](int64_t i, int64_t j) {
        const float scaled = ew::Mul(Load(u, i, j), Load(f, i, 0));
        Store(p, i, j,
              ew::UpdateParam(Load(p, i, j), scaled, lrs[k], decay, m));
      });
    }
    return absl::OkStatus();
  }

  absl::Status ApplyUpdate(const MatrixView& param, const MatrixView& update,
                           float lr, float decay,
                           WeightDecayMethod method) override {
    RETURN_IF_ERROR(CheckUpdate(param, update));
    const int m = static_cast<int>(method);
    RowScratch& rows = ThreadRowScratch();
    float* stepped = RowOfSize(rows.out[0], param.cols);
    for (int64_t i = 0; i < param.rows; ++i) {
      const float* p = FloatRow(param, i, rows.in[0]);
      const float* u = FloatRow(update, i, rows.in[1]);
      for (int64_t j = 0; j < param.cols; ++j) {
        stepped[j] = ew::UpdateParam(p[j], u[j], lr, decay, m);
      }
      StoreFloatRow(param, i, stepped);
    }
    return absl::OkStatus();
  }

  using Backend::AdamW;
  absl::Status AdamW(const MatrixView& param, const MatrixView& grad,
                     const MatrixView& exp_avg, const MatrixView& exp_avg_sq,
                     const AdamWScalars& s,
                     const AdamWMomentScales& scales) override {
    RETURN_IF_ERROR(CheckAdamW(param, grad, exp_avg, exp_avg_sq, scales));
    if (exp_avg.dtype == DType::kFloat8E4M3) {
      AdamWFp8(param, grad, exp_avg, exp_avg_sq, s, scales);
      return absl::OkStatus();
    }
    ForEach(param, [&](int64_t i, int64_t j) {
      const ew::AdamWOut o = ew::AdamWElement(
          Load(param, i, j), Load(grad, i, j), Load(exp_avg, i, j),
          Load(exp_avg_sq, i, j), s.param_decay, s.one_minus_beta1, s.beta2,
          s.one_minus_beta2, s.step_size, s.bias_correction2_sqrt, s.eps);
      Store(param, i, j, o.p);
      Store(exp_avg, i, j, o.m);
      Store(exp_avg_sq, i, j, o.v);
    });
    return absl::OkStatus();
  }

  absl::Status NorMuonRowStats(absl::Span<const NorMuonRowBlock> blocks,
                               const MatrixView& state,
                               const MatrixView& stats) override {
    RETURN_IF_ERROR(CheckNorMuonBlocks(blocks, state, stats, {}, {}));
    float* out = static_cast<float*>(stats.data);
    std::fill(out, out + stats.rows, 0.0f);
    const float* v = static_cast<const float*>(state.data);
    for (const NorMuonRowBlock& b : blocks) {
      for (int64_t r = 0; r < b.valid; ++r) {
        const int64_t at = b.stats_offset + b.global0 + r;
        if (b.adds_sums) out[at] = RowSumSquares(b.update, r);
        if (b.speaks_state) out[at + b.full_rows] = v[b.row_offset + r];
      }
    }
    return absl::OkStatus();
  }

  absl::Status SumSlices(const MatrixView& slices,
                         const MatrixView& out) override {
    RETURN_IF_ERROR(CheckSumSlices(slices, out));
    for (int64_t k = 0; k < slices.cols; ++k) {
      float sum = 0.0f;
      for (int64_t r = 0; r < slices.rows; ++r) sum += Load(slices, r, k);
      Store(out, k, 0, sum);
    }
    return absl::OkStatus();
  }

  absl::Status NorMuonFactors(absl::Span<const NorMuonRowBlock> blocks,
                              const MatrixView& stats, const MatrixView& state,
                              const MatrixView& staged,
                              const MatrixView& factors, double beta2,
                              double eps) override {
    RETURN_IF_ERROR(CheckNorMuonBlocks(blocks, state, stats, staged, factors));
    const float w = static_cast<float>(1.0 - beta2);
    const float* all = static_cast<const float*>(stats.data);
    const float* v = static_cast<const float*>(state.data);
    float* v_out = static_cast<float*>(staged.data);
    float* f = static_cast<float*>(factors.data);
    for (const NorMuonRowBlock& b : blocks) {
      const float* sums = all + b.stats_offset;
      const float* v_old = sums + b.full_rows;
      auto v_new = [&](int64_t i) {
        return ew::NorMuonRowState(v_old[i], sums[i], b.full_cols, w);
      };
      double n1 = 0.0, n2 = 0.0;
      if (!b.skip) {
        for (int64_t i = 0; i < b.full_rows; ++i) {
          n1 += sums[i];
          n2 += ew::NorMuonN2Term(sums[i], ew::NorMuonDenom(v_new(i), eps));
        }
      }
      const double ratio = ew::NorMuonRatio(n1, n2, eps);
      for (int64_t r = 0; r < b.update.rows; ++r) {
        const int64_t row = b.row_offset + r;
        if (b.skip || r >= b.valid) {
          v_out[row] = v[row];
          f[row] = 1.0f;
          continue;
        }
        v_out[row] = v_new(b.global0 + r);
        f[row] = ew::NorMuonRowFactor(ratio, ew::NorMuonDenom(v_out[row], eps));
      }
    }
    return absl::OkStatus();
  }

  absl::Status AdaMuonNormalize(const MatrixView& update,
                                const MatrixView& v_in, const MatrixView& v_out,
                                double beta2, float eps) override {
    RETURN_IF_ERROR(CheckAdaMuon(update, v_in, v_out));
    const float w = static_cast<float>(1.0 - beta2);
    ForEach(update, [&](int64_t i, int64_t j) {
      const ew::AdaMuonOut o =
          ew::AdaMuonElement(Load(update, i, j), Load(v_in, i, j), w, eps);
      Store(v_out, i, j, o.v);
      Store(update, i, j, o.u);
    });
    return absl::OkStatus();
  }

  absl::StatusOr<bool> AllFiniteBelow(absl::Span<const MatrixView> views,
                                      float limit) override {
    for (const MatrixView& v : views)
      RETURN_IF_ERROR(CheckView(v, "all_finite"));
    for (const MatrixView& v : views) {
      for (int64_t i = 0; i < v.rows; ++i) {
        for (int64_t j = 0; j < v.cols; ++j) {
          // False for NaN too.
          if (!(std::fabs(Load(v, i, j)) < limit)) return false;
        }
      }
    }
    return true;
  }

  absl::Status Synchronize() override { return absl::OkStatus(); }

 private:
  absl::Status CheckPrecision(MatmulPrecision p) const {
    if (!SupportsPrecision(p)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gemm: precision ", std::string(MatmulPrecisionName(p)),
          " is not available on the CPU backend (it has highest and medium)"));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend() {
  return std::make_unique<CpuBackend>();
}

int CpuGemmCallerLimit() {
  static const int limit = [] {
    constexpr int kIfUnsaid = 64;  // Debian's build
    const char* config = openblas_get_config();
    const char* at =
        config == nullptr ? nullptr : std::strstr(config, "MAX_THREADS=");
    const int built = at == nullptr ? 0 : std::atoi(at + 12);
    return built > 0 ? built : kIfUnsaid;
  }();
  return limit;
}

void ExpectConcurrentCpuGemmCallers(int callers) {
  if (callers <= 1) return;
  static std::once_flag single_threaded;
  std::call_once(single_threaded, [] { openblas_set_num_threads(1); });
}

}  // namespace muond
