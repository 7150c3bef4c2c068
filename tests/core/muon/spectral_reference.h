#pragma once
// Matrices with known singular values, and the fp64 value of muond's
// Newton–Schulz polynomial on them, without an SVD or an fp64 NS loop:
//   X = U diag(s) V^T  (U, V orthonormal columns, random, in double)
//   NS(X) = U diag(p(s / ||s||_2)) V^T
// where p is the composed scalar map x <- a x + b x^3 + c x^5 of the
// coefficient schedule, and ||s||_2 = ||X||_F is muond's Frobenius
// normalisation (X / max(||X||_F, eps)). This is what standard and Gram NS
// both compute in exact arithmetic, so their rounding errors can be compared
// against one exact answer on spectra chosen to be hard (log-decaying,
// rank-deficient, tiny and huge norms, zero).
#include <cstdint>
#include <memory>
#include <vector>

#include "tests/core/muon/ns_reference.h"

namespace muond::testing {

// An n x n orthogonal transform, random from `seed`, applied to vectors.
// Haar-distributed (Householder QR of a Gaussian matrix) for n <= 512;
// beyond that, for n a power of two, two rounds of random signs and the
// normalised Walsh–Hadamard transform (dense, O(n log n) per vector), so
// 4096-wide cases build in well under a second.
class RandomOrthogonal {
 public:
  RandomOrthogonal(int n, uint32_t seed);
  int n() const { return n_; }
  // x <- Q x (x has n entries).
  void Apply(double* x) const;

 private:
  int n_;
  // Householder form: reflectors v_j (length n - j, stored in full rows of
  // n) with tau_j, and the signs that make Q Haar (R's diagonal signs).
  std::vector<double> v_, tau_, diag_sign_;
  std::vector<double> sign1_, sign2_;  // Hadamard form
  bool hadamard_ = false;
};

// One matrix rows x cols with singular values s (length min(rows, cols),
// any order, >= 0) and random singular vectors.
class KnownSpectrum {
 public:
  KnownSpectrum(int rows, int cols, std::vector<double> s, uint32_t seed);
  int rows() const { return rows_; }
  int cols() const { return cols_; }
  const std::vector<double>& s() const { return s_; }
  // U diag(d) V^T, row-major rows x cols (d has min(rows, cols) entries).
  Mat Compose(const std::vector<double>& d) const;
  // The input: U diag(s) V^T.
  Mat Input() const { return Compose(s_); }
  // The exact NS result: U diag(p(s / max(||s||_2, eps))) V^T.
  Mat NsExact(const std::vector<Abc>& schedule, double eps) const;

 private:
  int rows_, cols_, m_, n_;  // m = min side, n = max side (wide orientation)
  std::vector<double> s_;
  std::unique_ptr<RandomOrthogonal> left_, right_;  // m x m and n x n
  Mat right_cols_;                                  // m x n: row i is R e_i
};

// p(x): the composed scalar NS map of `schedule`.
double NsScalar(double x, const std::vector<Abc>& schedule);
// max of p over [0, 1] (a fine grid refined around the best point): the
// largest singular value exact NS can produce from a normalised input.
double NsScalarMaxOn01(const std::vector<Abc>& schedule);

// Largest singular value of a row-major rows x cols matrix, by power
// iteration on x -> A^T A x in double from a fixed random start (`iters`
// iterations). A lower bound that converges to sigma_max; a blown-up
// direction (the failure the bound tests look for) dominates quickly.
// +infinity when any entry is inf or NaN (a blow-up past the dtype's range).
double SigmaMax(const std::vector<float>& a, int rows, int cols,
                int iters = 300);

// Relative Frobenius error ||got - want|| / ||want|| (want != 0).
double RelError(const std::vector<float>& got, const Mat& want);

}  // namespace muond::testing
