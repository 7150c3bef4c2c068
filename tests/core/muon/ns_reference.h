#pragma once
// Independent fp64 references for the Muon tests: a plain-loop Newton–Schulz
// that transposes explicitly (unlike muond's transposed GEMMs), and the polar
// factor U V^T via a Jacobi eigendecomposition.
#include <algorithm>
#include <cmath>
#include <vector>

namespace muond::testing {

using Mat = std::vector<double>;  // row-major

inline Mat Transpose(const Mat& a, int r, int c) {
  Mat t(a.size());
  for (int i = 0; i < r; ++i)
    for (int j = 0; j < c; ++j) t[j * r + i] = a[i * c + j];
  return t;
}

inline Mat MatMul(const Mat& a, const Mat& b, int m, int k, int n) {
  Mat c(size_t(m) * n, 0.0);
  for (int i = 0; i < m; ++i)
    for (int l = 0; l < k; ++l) {
      const double x = a[i * k + l];
      for (int j = 0; j < n; ++j) c[i * n + j] += x * b[l * n + j];
    }
  return c;
}

struct Abc {
  double a, b, c;
};

// X = G / max(||G||_F, eps); transpose if rows > cols; per step
// A = X X^T, B = bA + cA^2, X = aX + BX; transpose back.
inline Mat NewtonSchulzRef(const std::vector<float>& g, int rows, int cols,
                           const std::vector<Abc>& schedule, double eps) {
  Mat x(g.begin(), g.end());
  const bool tall = rows > cols;
  int m = rows, n = cols;
  if (tall) {
    x = Transpose(x, rows, cols);
    std::swap(m, n);
  }
  double ss = 0;
  for (double v : x) ss += v * v;
  const double d = std::max(std::sqrt(ss), eps);
  for (double& v : x) v /= d;
  for (const Abc& k : schedule) {
    const Mat xt = Transpose(x, m, n);
    const Mat a = MatMul(x, xt, m, n, m);
    const Mat a2 = MatMul(a, a, m, m, m);
    Mat b(a.size());
    for (size_t i = 0; i < a.size(); ++i) b[i] = k.b * a[i] + k.c * a2[i];
    const Mat bx = MatMul(b, x, m, m, n);
    for (size_t i = 0; i < x.size(); ++i) x[i] = k.a * x[i] + bx[i];
  }
  return tall ? Transpose(x, m, n) : x;
}

// Gram Newton–Schulz in plain fp64 loops, transposing explicitly for tall
// inputs (muond runs the transposed iteration instead): X normalised,
// R = X X^T; per step (a, b, c) at i: restart (i in `restarts`, i > 0):
// X = Q X, R = X X^T; Z = bR + cR^2; Q = Z + aI at 0/restarts else
// Q = QZ + aQ; unless last or i+1 a restart R = Z(RZ + aR) + a(RZ + aR);
// result Q X.
inline Mat GramNewtonSchulzRef(const std::vector<float>& g, int rows, int cols,
                               const std::vector<Abc>& schedule,
                               const std::vector<int>& restarts, double eps) {
  Mat x(g.begin(), g.end());
  const bool tall = rows > cols;
  int m = rows, n = cols;
  if (tall) {
    x = Transpose(x, rows, cols);
    std::swap(m, n);
  }
  double ss = 0;
  for (double v : x) ss += v * v;
  const double d = std::max(std::sqrt(ss), eps);
  for (double& v : x) v /= d;
  auto is_restart = [&](int i) {
    return i > 0 &&
           std::find(restarts.begin(), restarts.end(), i) != restarts.end();
  };
  auto axpy = [](const Mat& p, double s, const Mat& q) {  // p + s q
    Mat o(p.size());
    for (size_t i = 0; i < p.size(); ++i) o[i] = p[i] + s * q[i];
    return o;
  };
  Mat r = MatMul(x, Transpose(x, m, n), m, n, m), q;
  const int steps = int(schedule.size());
  for (int i = 0; i < steps; ++i) {
    const Abc& k = schedule[i];
    if (is_restart(i)) {
      x = MatMul(q, x, m, m, n);
      r = MatMul(x, Transpose(x, m, n), m, n, m);
    }
    const Mat r2 = MatMul(r, r, m, m, m);
    Mat z(r.size());
    for (size_t e = 0; e < z.size(); ++e) z[e] = k.b * r[e] + k.c * r2[e];
    if (i == 0 || is_restart(i)) {
      q = z;
      for (int j = 0; j < m; ++j) q[j * m + j] += k.a;
    } else {
      q = axpy(MatMul(q, z, m, m, m), k.a, q);
    }
    if (i + 1 < steps && !is_restart(i + 1)) {
      const Mat rz = axpy(MatMul(r, z, m, m, m), k.a, r);
      r = axpy(MatMul(z, rz, m, m, m), k.a, rz);
    }
  }
  x = MatMul(q, x, m, m, n);
  return tall ? Transpose(x, m, n) : x;
}

// Eigen-decomposition of a symmetric n x n matrix by cyclic Jacobi:
// a = V diag(w) V^T.
inline void Jacobi(Mat a, int n, std::vector<double>* w, Mat* v) {
  v->assign(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) (*v)[i * n + i] = 1.0;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) off += a[p * n + q] * a[p * n + q];
    if (off < 1e-30) break;
    for (int p = 0; p < n; ++p)
      for (int q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (std::fabs(apq) < 1e-300) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1 : -1) /
                         (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - s * akq;
          a[k * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - s * aqk;
          a[q * n + k] = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {
          const double vkp = (*v)[k * n + p], vkq = (*v)[k * n + q];
          (*v)[k * n + p] = c * vkp - s * vkq;
          (*v)[k * n + q] = s * vkp + c * vkq;
        }
      }
  }
  w->resize(n);
  for (int i = 0; i < n; ++i) (*w)[i] = a[i * n + i];
}

// Polar factor U V^T of a full-rank wide G (rows <= cols):
// (G G^T)^{-1/2} G.
inline Mat PolarFactor(const std::vector<float>& g, int rows, int cols) {
  const Mat x(g.begin(), g.end());
  const Mat gg = MatMul(x, Transpose(x, rows, cols), rows, cols, rows);
  std::vector<double> w;
  Mat v;
  Jacobi(gg, rows, &w, &v);
  Mat inv_sqrt(size_t(rows) * rows, 0.0);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < rows; ++j)
      for (int k = 0; k < rows; ++k)
        inv_sqrt[i * rows + j] +=
            v[i * rows + k] * v[j * rows + k] / std::sqrt(w[k]);
  return MatMul(inv_sqrt, x, rows, rows, cols);
}

inline double RelFrobDiff(const std::vector<float>& got, const Mat& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace muond::testing
