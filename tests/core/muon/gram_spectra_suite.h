#pragma once
// The Gram Newton–Schulz numerics suite, written once over a Backend and run
// by gram_spectra_test (CPU, in CI) and gram_spectra_cuda_test (tag gpu).
//
// Every case compares against the fp64 value of the same polynomial on a
// known spectrum (spectral_reference.h), batch of 2, fp32 in and out:
//  - Errors: for flat, log-decaying (1 .. 1e-9), rank-deficient (half
//    zeros) spectra, the relative Frobenius error of Gram NS (kMedium, fp16,
//    the default iteration dtype) is at most kGramFp16Slack x that of
//    standard NS in bf16 (kMedium, what muond ran before Gram); Gram in
//    bf16 at most kGramBf16Slack x. Standard NS in fp32 (kHighest) is
//    checked too: it calibrates the harness (a wrong reference fails it).
//  - Scale invariance: the log-decaying input times 2^-100 (~7.9e-31) and
//    2^100 (~1.3e30) gives bitwise the unscaled result (a power of two
//    commutes with the fp64 norm, the fp32 division and every rounding
//    after it); all-zero gives exactly zero. Every output is finite.
//  - sigma_max: on inputs where rounding makes spurious negative Gram
//    eigenvalues, Gram with restarts keeps sigma_max(out) <= max_[0,1] p +
//    kSigmaSlack, and the same run without restarts exceeds that bound, so
//    the check fails if the restart is removed (cases in CheckSigmaMaxBound);
//    and at every shape class the default sends to Gram, bf16 inputs of
//    four kinds, every built-in set but cans (CheckSigmaMaxAtShapeClasses).
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend/backend.h"
#include "core/muon/newton_schulz.h"

namespace muond::testing {

struct SpectraShape {
  int rows, cols;
};

// Gram fp16 vs standard bf16: fp16 keeps 3 more mantissa bits than bf16, so
// Gram's error is normally well below standard's (measured 3-10x below on
// CPU: 0.02-0.05 vs 0.10-0.18 on log and rank-deficient spectra); 1.25 only
// absorbs the seed-to-seed spread of two different rounding sequences, so an
// fp16 path that lost its advantage still passes but one that is worse than
// what it replaces does not.
inline constexpr double kGramFp16Slack = 1.25;
// Gram bf16 vs standard bf16: the same 8-bit mantissa through a longer
// chain (R is squared every step, Q accumulates the product): measured on
// CPU 1.0-1.6x standard's error on flat and log spectra and 2.4-3.1x on
// rank-deficient ones (the null space's rounding noise is amplified by
// p'(0) ~ 500 through Q); 4 bounds that. This is why fp16 is the default.
inline constexpr double kGramBf16Slack = 4.0;
// sigma_max above max p: output rounding (measured on CPU <= 0.02 above max
// p with restarts, the most in bf16); the spurious-eigenvalue growth without
// restarts is measured >= 1.0 above on the shapes that expect it.
inline constexpr double kSigmaSlack = 0.05;

// NS on `backend`: `in` is batch matrices rows x cols stacked along rows
// (fp32, host); returns the fp32 host output.
std::vector<float> RunNs(Backend* backend, const NsOptions& options,
                         const std::vector<float>& in, int rows, int cols,
                         int batch);

// The error / finiteness / scale-invariance checks over every shape
// (gtest expectations; prints one table row per shape x spectrum).
void CheckSpectraErrors(Backend* backend,
                        const std::vector<SpectraShape>& shapes);

// The sigma_max bound for quintic and polar_express, fp16 and bf16, on each
// shape: with the dtype's default restarts (DefaultGramRestarts) always; the
// growth without restarts only where `expect_growth` (small m: rounding of R =
// X X^T perturbs its eigenvalues by ~2^-11 |R_ij| sqrt(m), and |R_ij| ~ 1/m, so
// the spurious negative eigenvalues shrink as m grows; in an fp16 emulation at
// 1024 x 4096 the quintic run without restarts stays below the bound).
// Measured on the CPU, log-decaying inputs: with the default restarts
// sigma_max 1.12-1.13; without restarts in fp16 2.2-2.7 (quintic) and 55-85
// (polar_express) against the bounds 1.20 and 1.17. The old dtype-blind
// default {1} for polar_express x 5 measured 1.75-1.89 in fp16, which led to
// the tuner's output check (tools/gram_restart_tuner.py).
struct SigmaShape {
  int rows, cols;
  bool expect_growth;
};
void CheckSigmaMaxBound(Backend* backend,
                        const std::vector<SigmaShape>& shapes);

// sigma_max where the default sends Gram NS its inputs: every built-in
// coefficient set but cans (which diverges above sigma = 1 in any 16-bit
// NS) at 5 steps, fp16 and bf16, its default restarts
// (DefaultGramRestarts), on each shape with bf16 inputs as the medium path
// feeds NS (Gaussian; log-decaying 1 .. 1e-9; ranks m/2 and m/8, exact zeros
// as a weight that saw few tokens has): every output finite and within
// max_[0,1] p + kSigmaSlack. The tuner's output check runs the same kinds of
// input (tools/gram_restart_tuner.py EMU_SHAPES) with other seeds.
void CheckSigmaMaxAtShapeClasses(Backend* backend,
                                 const std::vector<SpectraShape>& shapes);

}  // namespace muond::testing
