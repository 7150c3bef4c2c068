#include "tests/core/muon/spectral_reference.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <thread>

namespace muond::testing {
namespace {

constexpr int kMaxHaar = 512;

// f(0..n-1) over the host's cores (the 4096-wide GPU cases build in well
// under a second); f must only write its own index's output.
void ParallelFor(int n, const std::function<void(int)>& f) {
  const int workers =
      std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w)
    threads.emplace_back([&, w] {
      for (int i = w; i < n; i += workers) f(i);
    });
  for (std::thread& t : threads) t.join();
}

bool PowerOfTwo(int n) { return n > 0 && (n & (n - 1)) == 0; }

// In-place normalised Walsh–Hadamard transform (symmetric, orthogonal).
void Fwht(double* x, int n) {
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const double a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const double scale = 1.0 / std::sqrt(double(n));
  for (int i = 0; i < n; ++i) x[i] *= scale;
}

std::vector<double> RandomSigns(int n, std::mt19937_64& rng) {
  std::vector<double> s(n);
  for (double& v : s) v = (rng() & 1) ? 1.0 : -1.0;
  return s;
}

}  // namespace

RandomOrthogonal::RandomOrthogonal(int n, uint32_t seed) : n_(n) {
  std::mt19937_64 rng(seed);
  if (n > kMaxHaar && PowerOfTwo(n)) {
    hadamard_ = true;
    sign1_ = RandomSigns(n, rng);
    sign2_ = RandomSigns(n, rng);
    return;
  }
  // Householder QR of a Gaussian matrix (column-major a[j * n + i] = A_ij):
  // Q = H_0 ... H_{n-1} diag(sign(R_jj)) is Haar-distributed.
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> a(size_t(n) * n);
  for (double& x : a) x = normal(rng);
  v_.assign(size_t(n) * n, 0.0);
  tau_.assign(n, 0.0);
  diag_sign_.assign(n, 1.0);
  for (int j = 0; j < n; ++j) {
    double* col = &a[size_t(j) * n];
    double norm2 = 0;
    for (int i = j; i < n; ++i) norm2 += col[i] * col[i];
    const double alpha = (col[j] >= 0 ? -1.0 : 1.0) * std::sqrt(norm2);
    double* v = &v_[size_t(j) * n];
    for (int i = j; i < n; ++i) v[i] = col[i];
    v[j] -= alpha;
    double vv = 0;
    for (int i = j; i < n; ++i) vv += v[i] * v[i];
    tau_[j] = vv > 0 ? 2.0 / vv : 0.0;
    diag_sign_[j] = alpha >= 0 ? 1.0 : -1.0;  // R_jj = alpha
    for (int k = j + 1; k < n; ++k) {
      double* ck = &a[size_t(k) * n];
      double dot = 0;
      for (int i = j; i < n; ++i) dot += v[i] * ck[i];
      dot *= tau_[j];
      for (int i = j; i < n; ++i) ck[i] -= dot * v[i];
    }
  }
}

void RandomOrthogonal::Apply(double* x) const {
  if (hadamard_) {
    for (int i = 0; i < n_; ++i) x[i] *= sign2_[i];
    Fwht(x, n_);
    for (int i = 0; i < n_; ++i) x[i] *= sign1_[i];
    Fwht(x, n_);
    return;
  }
  for (int i = 0; i < n_; ++i) x[i] *= diag_sign_[i];
  for (int j = n_ - 1; j >= 0; --j) {
    const double* v = &v_[size_t(j) * n_];
    double dot = 0;
    for (int i = j; i < n_; ++i) dot += v[i] * x[i];
    dot *= tau_[j];
    for (int i = j; i < n_; ++i) x[i] -= dot * v[i];
  }
}

KnownSpectrum::KnownSpectrum(int rows, int cols, std::vector<double> s,
                             uint32_t seed)
    : rows_(rows),
      cols_(cols),
      m_(std::min(rows, cols)),
      n_(std::max(rows, cols)),
      s_(std::move(s)),
      left_(std::make_unique<RandomOrthogonal>(m_, seed)),
      right_(std::make_unique<RandomOrthogonal>(n_, seed * 2654435761u + 1)) {
  // The right singular vectors R e_i (i < m), kept for every Compose.
  right_cols_.assign(size_t(m_) * n_, 0.0);
  ParallelFor(m_, [&](int i) {
    double* e = &right_cols_[size_t(i) * n_];
    e[i] = 1.0;
    right_->Apply(e);
  });
}

Mat KnownSpectrum::Compose(const std::vector<double>& d) const {
  // W^T (n x m, row-major) of the wide orientation W = L [diag(d) 0] R^T:
  // row j of W^T is L applied to (d_i (R e_i)_j)_i, a contiguous m-vector.
  Mat wt(size_t(n_) * m_);
  ParallelFor(n_, [&](int j) {
    double* row = &wt[size_t(j) * m_];
    for (int i = 0; i < m_; ++i)
      row[i] = d[i] == 0.0 ? 0.0 : d[i] * right_cols_[size_t(i) * n_ + j];
    left_->Apply(row);
  });
  // Tall (rows = n): the result is W^T itself.
  return rows_ > cols_ ? wt : Transpose(wt, n_, m_);
}

Mat KnownSpectrum::NsExact(const std::vector<Abc>& schedule, double eps) const {
  double ss = 0;
  for (double v : s_) ss += v * v;
  const double denom = std::max(std::sqrt(ss), eps);
  std::vector<double> d(s_.size());
  for (size_t i = 0; i < s_.size(); ++i)
    d[i] = NsScalar(s_[i] / denom, schedule);
  return Compose(d);
}

double NsScalar(double x, const std::vector<Abc>& schedule) {
  for (const Abc& k : schedule) {
    const double x2 = x * x;
    x = x * (k.a + x2 * (k.b + x2 * k.c));
  }
  return x;
}

double NsScalarMaxOn01(const std::vector<Abc>& schedule) {
  constexpr int kGrid = 1 << 20;
  double best_x = 0, best = 0;
  for (int i = 0; i <= kGrid; ++i) {
    const double x = double(i) / kGrid;
    const double y = NsScalar(x, schedule);
    if (y > best) best = y, best_x = x;
  }
  // Refine around the grid maximum (p is smooth; 1e-6 steps then 1e-9).
  for (double h : {1.0 / kGrid / 1024, 1.0 / kGrid / 1024 / 1024}) {
    const double x0 = best_x;
    for (int i = -1024; i <= 1024; ++i) {
      const double x = std::clamp(x0 + i * h, 0.0, 1.0);
      const double y = NsScalar(x, schedule);
      if (y > best) best = y, best_x = x;
    }
  }
  return best;
}

double SigmaMax(const std::vector<float>& a, int rows, int cols, int iters) {
  for (float x : a)
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
  std::mt19937_64 rng(12345);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> v(cols), u(rows);
  for (double& x : v) x = normal(rng);
  double sigma = 0;
  for (int it = 0; it < iters; ++it) {
    double vn = 0;
    for (double x : v) vn += x * x;
    vn = std::sqrt(vn);
    if (vn == 0) return 0.0;
    for (double& x : v) x /= vn;
    // u = A v; sigma = ||A v|| with ||v|| = 1; v = A^T u (over column
    // blocks, each summed over rows in order: deterministic).
    ParallelFor(rows, [&](int i) {
      double acc = 0;
      const float* row = &a[size_t(i) * cols];
      for (int j = 0; j < cols; ++j) acc += double(row[j]) * v[j];
      u[i] = acc;
    });
    double un = 0;
    for (double x : u) un += x * x;
    sigma = std::max(sigma, std::sqrt(un));
    constexpr int kBlock = 64;
    ParallelFor((cols + kBlock - 1) / kBlock, [&](int blk) {
      const int j0 = blk * kBlock, j1 = std::min(cols, j0 + kBlock);
      for (int j = j0; j < j1; ++j) v[j] = 0.0;
      for (int i = 0; i < rows; ++i) {
        const float* row = &a[size_t(i) * cols];
        for (int j = j0; j < j1; ++j) v[j] += double(row[j]) * u[i];
      }
    });
  }
  return sigma;
}

double RelError(const std::vector<float>& got, const Mat& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(got[i]) - want[i];
    num += d * d;
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

}  // namespace muond::testing
