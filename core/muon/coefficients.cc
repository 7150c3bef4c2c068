#include "core/muon/coefficients.h"

#include <cmath>
#include <initializer_list>
#include <string>

#include "absl/strings/str_cat.h"

namespace muond {
namespace {

const std::vector<NsCoefficients>& Simple() {
  static const auto* v =
      new std::vector<NsCoefficients>{{3.4445f, -4.7750f, 2.0315f}};
  return *v;
}

}  // namespace

std::string_view CoefficientTypeName(CoefficientType type) {
  switch (type) {
    case CoefficientType::kSimple:
      return "simple";
    case CoefficientType::kQuintic:
      return "quintic";
    case CoefficientType::kPolarExpress:
      return "polar_express";
    case CoefficientType::kAol:
      return "aol";
    case CoefficientType::kCans:
      return "cans";
    case CoefficientType::kDeepseekV4:
      return "deepseekv4";
    case CoefficientType::kCustom:
      return "custom";
  }
  return "unknown";
}

absl::StatusOr<CoefficientType> ParseCoefficientType(std::string_view name) {
  for (CoefficientType t :
       {CoefficientType::kSimple, CoefficientType::kQuintic,
        CoefficientType::kPolarExpress, CoefficientType::kAol,
        CoefficientType::kCans, CoefficientType::kDeepseekV4,
        CoefficientType::kCustom}) {
    if (CoefficientTypeName(t) == name) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "coefficient_type: unknown name '", std::string(name),
      "'; expected simple, quintic, polar_express, aol, cans, deepseekv4 or "
      "custom"));
}

const std::vector<NsCoefficients>& BuiltinCoefficients(CoefficientType type) {
  static const auto* quintic =
      new std::vector<NsCoefficients>{{4.0848f, -6.8946f, 2.9270f},
                                      {3.9505f, -6.3029f, 2.6377f},
                                      {3.7418f, -5.5913f, 2.3037f},
                                      {2.8769f, -3.1427f, 1.2046f},
                                      {2.8366f, -3.0525f, 1.2012f}};
  static const auto* polar_express = new std::vector<NsCoefficients>{
      {8.2051f, -22.9019f, 16.4607f}, {4.0664f, -2.8612f, 0.5184f},
      {3.9096f, -2.8234f, 0.5250f},   {3.2856f, -2.4153f, 0.4853f},
      {2.2779f, -1.6198f, 0.3985f},   {1.8726f, -1.2307f, 0.3585f},
      {1.8564f, -1.2132f, 0.3568f},   {1.8750f, -1.2500f, 0.3750f}};
  static const auto* aol =
      new std::vector<NsCoefficients>{{4.0098f, -7.0585f, 2.4635f},
                                      {3.4585f, -5.5479f, 2.5959f},
                                      {2.7573f, -3.2939f, 1.4254f},
                                      {2.7215f, -3.0494f, 1.3169f}};
  static const auto* cans =
      new std::vector<NsCoefficients>{{8.4703f, -25.1081f, 18.6293f},
                                      {4.1828f, -3.1087f, 0.5806f},
                                      {3.9619f, -2.9541f, 0.5630f},
                                      {3.2866f, -2.4647f, 0.5074f},
                                      {2.2737f, -1.6447f, 0.4162f}};
  static const auto* deepseekv4 = [] {
    auto* v = new std::vector<NsCoefficients>(8, Simple()[0]);
    v->push_back({2.0f, -1.5f, 0.5f});
    v->push_back({2.0f, -1.5f, 0.5f});
    return v;
  }();
  static const auto* none = new std::vector<NsCoefficients>{};
  switch (type) {
    case CoefficientType::kSimple:
      return Simple();
    case CoefficientType::kQuintic:
      return *quintic;
    case CoefficientType::kPolarExpress:
      return *polar_express;
    case CoefficientType::kAol:
      return *aol;
    case CoefficientType::kCans:
      return *cans;
    case CoefficientType::kDeepseekV4:
      return *deepseekv4;
    case CoefficientType::kCustom:
      return *none;
  }
  return *none;
}

CoefficientIterMode IterModeOf(CoefficientType type) {
  switch (type) {
    case CoefficientType::kPolarExpress:
    case CoefficientType::kCans:
    case CoefficientType::kDeepseekV4:
      return CoefficientIterMode::kRepeatLast;
    default:
      return CoefficientIterMode::kCycle;
  }
}

absl::StatusOr<std::vector<NsCoefficients>> CoefficientSchedule(
    CoefficientType type, const std::vector<NsCoefficients>& custom,
    int num_steps) {
  if (num_steps < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_steps must be >= 1, got ", num_steps));
  }
  const bool is_custom = type == CoefficientType::kCustom;
  if (is_custom && custom.empty()) {
    return absl::InvalidArgumentError(
        "custom coefficients: coefficient_type custom needs a non-empty list");
  }
  if (!is_custom && !custom.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("custom coefficients: given for coefficient_type ",
                     std::string(CoefficientTypeName(type)),
                     "; set coefficient_type custom"));
  }
  for (size_t i = 0; i < custom.size(); ++i) {
    const NsCoefficients& t = custom[i];
    if (!std::isfinite(t.a) || !std::isfinite(t.b) || !std::isfinite(t.c)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "custom coefficients: tuple ", i, " has a non-finite value"));
    }
  }
  const std::vector<NsCoefficients>& set =
      is_custom ? custom : BuiltinCoefficients(type);
  std::vector<NsCoefficients> out;
  out.reserve(num_steps);
  const bool repeat_last = IterModeOf(type) == CoefficientIterMode::kRepeatLast;
  for (int s = 0; s < num_steps; ++s) {
    const size_t n = set.size();
    out.push_back(repeat_last ? set[std::min<size_t>(s, n - 1)] : set[s % n]);
  }
  return out;
}

namespace {

struct GramRestartRow {
  CoefficientType type;
  int num_steps;
  DType iteration_dtype;
  std::initializer_list<int> restarts;
};

// Generated by
//   .venv/bin/python tools/gram_restart_tuner.py --max-steps 10  (~110 s CPU)
// Per coefficient set, num_steps and iteration dtype, the fewest restarts
// (>= 1) with a placement that passes two checks, the passing placement with
// the lowest cond(Q) within that count:
//  - cond(Q) < 1e8: the peer's score, the scalar iteration on Gram
//    eigenvalues sigma^2 - 4e-4 (sigma = logspace(0, -10, 10000));
//  - sigma: sigma_max of Gram NS emulated in numpy with this dtype's GEMM
//    rounding (fp32: TF32 operands) on 64 x 256 log-decaying and
//    rank-deficient inputs, at most max_[0,1] p + 0.05 (the bound after the
//    slash; the numerics suite's bound, tests/core/muon/gram_spectra_suite).
// The tuner's docstring has the rule and why the score alone picked unsafe
// rows (polar_express x 5 in fp16: {1}). tests/tools/gram_restart_tuner_test
// reruns it against this table. cans past 5 steps repeats a tuple that is
// not a fixed point at sigma = 1 and diverges on any algorithm; the rule
// then restarts every iteration.
// clang-format off
const GramRestartRow kGramRestartTable[] = {
    {CoefficientType::kSimple, 1, DType::kFloat16, {}},  // cond 4.91, sigma 1.203 / 1.252
    {CoefficientType::kSimple, 1, DType::kBFloat16, {}},  // cond 4.91, sigma 1.204 / 1.252
    {CoefficientType::kSimple, 1, DType::kFloat32, {}},  // cond 4.91, sigma 1.203 / 1.252
    {CoefficientType::kSimple, 2, DType::kFloat16, {1}},  // cond 5.4, sigma 1.203 / 1.252
    {CoefficientType::kSimple, 2, DType::kBFloat16, {1}},  // cond 5.4, sigma 1.206 / 1.252
    {CoefficientType::kSimple, 2, DType::kFloat32, {1}},  // cond 5.4, sigma 1.203 / 1.252
    {CoefficientType::kSimple, 3, DType::kFloat16, {2}},  // cond 13.4, sigma 1.202 / 1.252
    {CoefficientType::kSimple, 3, DType::kBFloat16, {2}},  // cond 13.4, sigma 1.204 / 1.252
    {CoefficientType::kSimple, 3, DType::kFloat32, {2}},  // cond 13.4, sigma 1.202 / 1.252
    {CoefficientType::kSimple, 4, DType::kFloat16, {2}},  // cond 20.2, sigma 1.202 / 1.252
    {CoefficientType::kSimple, 4, DType::kBFloat16, {2}},  // cond 20.2, sigma 1.209 / 1.252
    {CoefficientType::kSimple, 4, DType::kFloat32, {2}},  // cond 20.2, sigma 1.202 / 1.252
    {CoefficientType::kSimple, 5, DType::kFloat16, {3}},  // cond 62.5, sigma 1.203 / 1.252
    {CoefficientType::kSimple, 5, DType::kBFloat16, {2, 3}},  // cond 19.1, sigma 1.212 / 1.252
    {CoefficientType::kSimple, 5, DType::kFloat32, {3}},  // cond 62.5, sigma 1.203 / 1.252
    {CoefficientType::kSimple, 6, DType::kFloat16, {3}},  // cond 5.28e+04, sigma 1.229 / 1.252
    {CoefficientType::kSimple, 6, DType::kBFloat16, {2, 4}},  // cond 20.2, sigma 1.239 / 1.252
    {CoefficientType::kSimple, 6, DType::kFloat32, {3}},  // cond 5.28e+04, sigma 1.208 / 1.252
    {CoefficientType::kSimple, 7, DType::kFloat16, {2, 4}},  // cond 74.1, sigma 1.246 / 1.252
    {CoefficientType::kSimple, 7, DType::kBFloat16, {2, 4, 5}},  // cond 20.2, sigma 1.236 / 1.252
    {CoefficientType::kSimple, 7, DType::kFloat32, {2, 4}},  // cond 74.1, sigma 1.231 / 1.252
    {CoefficientType::kSimple, 8, DType::kFloat16, {2, 5}},  // cond 5.28e+04, sigma 1.225 / 1.252
    {CoefficientType::kSimple, 8, DType::kBFloat16, {2, 4, 6}},  // cond 20.2, sigma 1.227 / 1.252
    {CoefficientType::kSimple, 8, DType::kFloat32, {2, 5}},  // cond 5.28e+04, sigma 1.214 / 1.252
    {CoefficientType::kSimple, 9, DType::kFloat16, {2, 4, 6}},  // cond 74.1, sigma 1.204 / 1.252
    {CoefficientType::kSimple, 9, DType::kBFloat16, {2, 4, 5, 7}},  // cond 20.2, sigma 1.209 / 1.252
    {CoefficientType::kSimple, 9, DType::kFloat32, {2, 4, 6}},  // cond 74.1, sigma 1.203 / 1.252
    {CoefficientType::kSimple, 10, DType::kFloat16, {2, 4, 7}},  // cond 5.27e+04, sigma 1.202 / 1.219
    {CoefficientType::kSimple, 10, DType::kBFloat16, {2, 4, 6, 8}},  // cond 20.2, sigma 1.206 / 1.219
    {CoefficientType::kSimple, 10, DType::kFloat32, {2, 4, 6}},  // cond 668, sigma 1.202 / 1.219
    {CoefficientType::kQuintic, 1, DType::kFloat16, {}},  // cond 34.8, sigma 1.274 / 1.323
    {CoefficientType::kQuintic, 1, DType::kBFloat16, {}},  // cond 34.8, sigma 1.277 / 1.323
    {CoefficientType::kQuintic, 1, DType::kFloat32, {}},  // cond 34.8, sigma 1.273 / 1.323
    {CoefficientType::kQuintic, 2, DType::kFloat16, {1}},  // cond 34.8, sigma 1.270 / 1.320
    {CoefficientType::kQuintic, 2, DType::kBFloat16, {1}},  // cond 34.8, sigma 1.275 / 1.320
    {CoefficientType::kQuintic, 2, DType::kFloat32, {1}},  // cond 34.8, sigma 1.270 / 1.320
    {CoefficientType::kQuintic, 3, DType::kFloat16, {1}},  // cond 34.8, sigma 1.256 / 1.297
    {CoefficientType::kQuintic, 3, DType::kBFloat16, {2}},  // cond 53.2, sigma 1.251 / 1.297
    {CoefficientType::kQuintic, 3, DType::kFloat32, {1}},  // cond 34.8, sigma 1.268 / 1.297
    {CoefficientType::kQuintic, 4, DType::kFloat16, {2}},  // cond 53.2, sigma 1.151 / 1.197
    {CoefficientType::kQuintic, 4, DType::kBFloat16, {2}},  // cond 53.2, sigma 1.179 / 1.197
    {CoefficientType::kQuintic, 4, DType::kFloat32, {2}},  // cond 53.2, sigma 1.152 / 1.197
    {CoefficientType::kQuintic, 5, DType::kFloat16, {2}},  // cond 53.2, sigma 1.152 / 1.195
    {CoefficientType::kQuintic, 5, DType::kBFloat16, {2, 3}},  // cond 53.2, sigma 1.154 / 1.195
    {CoefficientType::kQuintic, 5, DType::kFloat32, {2}},  // cond 53.2, sigma 1.148 / 1.195
    {CoefficientType::kQuintic, 6, DType::kFloat16, {2, 5}},  // cond 165, sigma 1.274 / 1.323
    {CoefficientType::kQuintic, 6, DType::kBFloat16, {2, 4}},  // cond 360, sigma 1.311 / 1.323
    {CoefficientType::kQuintic, 6, DType::kFloat32, {2, 5}},  // cond 165, sigma 1.273 / 1.323
    {CoefficientType::kQuintic, 7, DType::kFloat16, {2, 5}},  // cond 167, sigma 1.274 / 1.320
    {CoefficientType::kQuintic, 7, DType::kBFloat16, {2, 4, 6}},  // cond 360, sigma 1.274 / 1.320
    {CoefficientType::kQuintic, 7, DType::kFloat32, {2, 5}},  // cond 167, sigma 1.274 / 1.320
    {CoefficientType::kQuintic, 8, DType::kFloat16, {2, 5, 6}},  // cond 165, sigma 1.256 / 1.297
    {CoefficientType::kQuintic, 8, DType::kBFloat16, {2, 4, 6, 7}},  // cond 360, sigma 1.253 / 1.297
    {CoefficientType::kQuintic, 8, DType::kFloat32, {2, 5, 6}},  // cond 165, sigma 1.259 / 1.297
    {CoefficientType::kQuintic, 9, DType::kFloat16, {2, 5, 7}},  // cond 167, sigma 1.150 / 1.197
    {CoefficientType::kQuintic, 9, DType::kBFloat16, {2, 4, 6, 7}},  // cond 360, sigma 1.184 / 1.197
    {CoefficientType::kQuintic, 9, DType::kFloat32, {2, 5, 7}},  // cond 167, sigma 1.151 / 1.197
    {CoefficientType::kQuintic, 10, DType::kFloat16, {2, 5, 7}},  // cond 167, sigma 1.145 / 1.166
    {CoefficientType::kQuintic, 10, DType::kBFloat16, {2, 4, 5, 6, 7}},  // cond 165, sigma 1.154 / 1.166
    {CoefficientType::kQuintic, 10, DType::kFloat32, {2, 5, 7}},  // cond 167, sigma 1.146 / 1.166
    {CoefficientType::kPolarExpress, 1, DType::kFloat16, {}},  // cond 34.3, sigma 1.992 / 2.042
    {CoefficientType::kPolarExpress, 1, DType::kBFloat16, {}},  // cond 34.3, sigma 1.998 / 2.042
    {CoefficientType::kPolarExpress, 1, DType::kFloat32, {}},  // cond 34.3, sigma 1.992 / 2.042
    {CoefficientType::kPolarExpress, 2, DType::kFloat16, {1}},  // cond 34.3, sigma 1.966 / 2.016
    {CoefficientType::kPolarExpress, 2, DType::kBFloat16, {1}},  // cond 34.3, sigma 1.970 / 2.016
    {CoefficientType::kPolarExpress, 2, DType::kFloat32, {1}},  // cond 34.3, sigma 1.966 / 2.016
    {CoefficientType::kPolarExpress, 3, DType::kFloat16, {1}},  // cond 170, sigma 1.870 / 1.916
    {CoefficientType::kPolarExpress, 3, DType::kBFloat16, {2}},  // cond 172, sigma 1.870 / 1.916
    {CoefficientType::kPolarExpress, 3, DType::kFloat32, {1}},  // cond 170, sigma 1.870 / 1.916
    {CoefficientType::kPolarExpress, 4, DType::kFloat16, {2}},  // cond 172, sigma 1.568 / 1.610
    {CoefficientType::kPolarExpress, 4, DType::kBFloat16, {2, 3}},  // cond 172, sigma 1.571 / 1.610
    {CoefficientType::kPolarExpress, 4, DType::kFloat32, {2}},  // cond 172, sigma 1.571 / 1.610
    {CoefficientType::kPolarExpress, 5, DType::kFloat16, {1, 3}},  // cond 170, sigma 1.129 / 1.174
    {CoefficientType::kPolarExpress, 5, DType::kBFloat16, {2, 3}},  // cond 1.74e+03, sigma 1.162 / 1.174
    {CoefficientType::kPolarExpress, 5, DType::kFloat32, {1, 3}},  // cond 170, sigma 1.131 / 1.174
    {CoefficientType::kPolarExpress, 6, DType::kFloat16, {1, 3}},  // cond 170, sigma 1.024 / 1.051
    {CoefficientType::kPolarExpress, 6, DType::kBFloat16, {1, 2, 3, 4}},  // cond 34.4, sigma 1.019 / 1.051
    {CoefficientType::kPolarExpress, 6, DType::kFloat32, {1, 3}},  // cond 170, sigma 1.045 / 1.051
    {CoefficientType::kPolarExpress, 7, DType::kFloat16, {1, 2, 4}},  // cond 57.4, sigma 1.004 / 1.050
    {CoefficientType::kPolarExpress, 7, DType::kBFloat16, {1, 2, 4}},  // cond 57.4, sigma 1.029 / 1.050
    {CoefficientType::kPolarExpress, 7, DType::kFloat32, {1, 2, 4}},  // cond 57.4, sigma 1.005 / 1.050
    {CoefficientType::kPolarExpress, 8, DType::kFloat16, {1, 2, 4}},  // cond 57.4, sigma 1.006 / 1.050
    {CoefficientType::kPolarExpress, 8, DType::kBFloat16, {1, 2, 3, 5}},  // cond 34.4, sigma 1.014 / 1.050
    {CoefficientType::kPolarExpress, 8, DType::kFloat32, {1, 2, 4}},  // cond 57.4, sigma 1.007 / 1.050
    {CoefficientType::kPolarExpress, 9, DType::kFloat16, {1, 2, 4}},  // cond 57.4, sigma 1.025 / 1.050
    {CoefficientType::kPolarExpress, 9, DType::kBFloat16, {1, 2, 3, 5}},  // cond 34.4, sigma 1.029 / 1.050
    {CoefficientType::kPolarExpress, 9, DType::kFloat32, {1, 2, 4}},  // cond 57.4, sigma 1.012 / 1.050
    {CoefficientType::kPolarExpress, 10, DType::kFloat16, {1, 2, 5}},  // cond 69.3, sigma 1.008 / 1.050
    {CoefficientType::kPolarExpress, 10, DType::kBFloat16, {1, 2, 3, 6}},  // cond 34.4, sigma 1.026 / 1.050
    {CoefficientType::kPolarExpress, 10, DType::kFloat32, {1, 2, 4}},  // cond 113, sigma 1.027 / 1.050
    {CoefficientType::kAol, 1, DType::kFloat16, {}},  // cond 826, sigma 1.209 / 1.258
    {CoefficientType::kAol, 1, DType::kBFloat16, {}},  // cond 826, sigma 1.212 / 1.258
    {CoefficientType::kAol, 1, DType::kFloat32, {}},  // cond 826, sigma 1.209 / 1.258
    {CoefficientType::kAol, 2, DType::kFloat16, {1}},  // cond 826, sigma 1.118 / 1.167
    {CoefficientType::kAol, 2, DType::kBFloat16, {1}},  // cond 826, sigma 1.122 / 1.167
    {CoefficientType::kAol, 2, DType::kFloat32, {1}},  // cond 826, sigma 1.118 / 1.167
    {CoefficientType::kAol, 3, DType::kFloat16, {1}},  // cond 826, sigma 1.059 / 1.105
    {CoefficientType::kAol, 3, DType::kBFloat16, {1}},  // cond 826, sigma 1.104 / 1.105
    {CoefficientType::kAol, 3, DType::kFloat32, {1}},  // cond 826, sigma 1.062 / 1.105
    {CoefficientType::kAol, 4, DType::kFloat16, {1}},  // cond 826, sigma 1.086 / 1.134
    {CoefficientType::kAol, 4, DType::kBFloat16, {2}},  // cond 834, sigma 1.086 / 1.134
    {CoefficientType::kAol, 4, DType::kFloat32, {1}},  // cond 826, sigma 1.085 / 1.134
    {CoefficientType::kAol, 5, DType::kFloat16, {3}},  // cond 1.49e+03, sigma 1.208 / 1.258
    {CoefficientType::kAol, 5, DType::kBFloat16, {1, 3}},  // cond 1.52e+03, sigma 1.211 / 1.258
    {CoefficientType::kAol, 5, DType::kFloat32, {3}},  // cond 1.49e+03, sigma 1.208 / 1.258
    {CoefficientType::kAol, 6, DType::kFloat16, {3}},  // cond 1.61e+03, sigma 1.166 / 1.167
    {CoefficientType::kAol, 6, DType::kBFloat16, {2, 4}},  // cond 1.95e+04, sigma 1.160 / 1.167
    {CoefficientType::kAol, 6, DType::kFloat32, {3}},  // cond 1.61e+03, sigma 1.149 / 1.167
    {CoefficientType::kAol, 7, DType::kFloat16, {3, 5}},  // cond 1.49e+03, sigma 1.057 / 1.105
    {CoefficientType::kAol, 7, DType::kBFloat16, {1, 3, 5}},  // cond 1.52e+03, sigma 1.075 / 1.105
    {CoefficientType::kAol, 7, DType::kFloat32, {3, 5}},  // cond 1.49e+03, sigma 1.057 / 1.105
    {CoefficientType::kAol, 8, DType::kFloat16, {3, 5}},  // cond 1.49e+03, sigma 1.096 / 1.134
    {CoefficientType::kAol, 8, DType::kBFloat16, {2, 4, 6}},  // cond 1.95e+04, sigma 1.095 / 1.134
    {CoefficientType::kAol, 8, DType::kFloat32, {3, 5}},  // cond 1.49e+03, sigma 1.089 / 1.134
    {CoefficientType::kAol, 9, DType::kFloat16, {3, 6}},  // cond 1.63e+03, sigma 1.213 / 1.256
    {CoefficientType::kAol, 9, DType::kBFloat16, {1, 3, 5, 6}},  // cond 1.52e+03, sigma 1.252 / 1.256
    {CoefficientType::kAol, 9, DType::kFloat32, {3, 6}},  // cond 1.63e+03, sigma 1.211 / 1.256
    {CoefficientType::kAol, 10, DType::kFloat16, {3, 6}},  // cond 2.85e+03, sigma 1.123 / 1.167
    {CoefficientType::kAol, 10, DType::kBFloat16, {2, 3, 5, 7}},  // cond 2.62e+03, sigma 1.141 / 1.167
    {CoefficientType::kAol, 10, DType::kFloat32, {3, 6}},  // cond 2.85e+03, sigma 1.133 / 1.167
    {CoefficientType::kCans, 1, DType::kFloat16, {}},  // cond 822, sigma 1.999 / 2.042
    {CoefficientType::kCans, 1, DType::kBFloat16, {}},  // cond 822, sigma 2.039 / 2.042
    {CoefficientType::kCans, 1, DType::kFloat32, {}},  // cond 822, sigma 2.003 / 2.042
    {CoefficientType::kCans, 2, DType::kFloat16, {1}},  // cond 822, sigma 2.055 / 2.015
    {CoefficientType::kCans, 2, DType::kBFloat16, {1}},  // cond 822, sigma 2.641 / 2.015
    {CoefficientType::kCans, 2, DType::kFloat32, {1}},  // cond 822, sigma 2.114 / 2.015
    {CoefficientType::kCans, 3, DType::kFloat16, {1, 2}},  // cond 822, sigma 3.136 / 1.910
    {CoefficientType::kCans, 3, DType::kBFloat16, {1, 2}},  // cond 822, sigma 28.351 / 1.910
    {CoefficientType::kCans, 3, DType::kFloat32, {1, 2}},  // cond 822, sigma 4.234 / 1.910
    {CoefficientType::kCans, 4, DType::kFloat16, {1, 2, 3}},  // cond 822, sigma 88.263 / 1.599
    {CoefficientType::kCans, 4, DType::kBFloat16, {1, 2, 3}},  // cond 822, sigma 9234747.545 / 1.599
    {CoefficientType::kCans, 4, DType::kFloat32, {1, 2, 3}},  // cond 822, sigma 517.373 / 1.599
    {CoefficientType::kCans, 5, DType::kFloat16, {1, 2, 3, 4}},  // cond 9.05e+03, sigma inf / 1.170
    {CoefficientType::kCans, 5, DType::kBFloat16, {1, 2, 3, 4}},  // cond 9.05e+03, sigma 27915517613502320507278486000369664.000 / 1.170
    {CoefficientType::kCans, 5, DType::kFloat32, {1, 2, 3, 4}},  // cond 9.05e+03, sigma 15433081358339.359 / 1.170
    {CoefficientType::kCans, 6, DType::kFloat16, {1, 2, 3, 4, 5}},  // cond 1.05e+19, sigma inf / 1.163
    {CoefficientType::kCans, 6, DType::kBFloat16, {1, 2, 3, 4, 5}},  // cond 1.05e+19, sigma inf / 1.163
    {CoefficientType::kCans, 6, DType::kFloat32, {1, 2, 3, 4, 5}},  // cond 1.05e+19, sigma inf / 1.163
    {CoefficientType::kCans, 7, DType::kFloat16, {1, 2, 3, 4, 5, 6}},  // cond 2.24e+94, sigma inf / 1.163
    {CoefficientType::kCans, 7, DType::kBFloat16, {1, 2, 3, 4, 5, 6}},  // cond 2.24e+94, sigma inf / 1.163
    {CoefficientType::kCans, 7, DType::kFloat32, {1, 2, 3, 4, 5, 6}},  // cond 2.24e+94, sigma inf / 1.163
    {CoefficientType::kCans, 8, DType::kFloat16, {1, 2, 3, 4, 5, 6, 7}},  // cond inf, sigma inf / 1.163
    {CoefficientType::kCans, 8, DType::kBFloat16, {1, 2, 3, 4, 5, 6, 7}},  // cond inf, sigma inf / 1.163
    {CoefficientType::kCans, 8, DType::kFloat32, {1, 2, 3, 4, 5, 6, 7}},  // cond inf, sigma inf / 1.163
    {CoefficientType::kCans, 9, DType::kFloat16, {1, 2, 3, 4, 5, 6, 7, 8}},  // cond inf, sigma inf / 1.162
    {CoefficientType::kCans, 9, DType::kBFloat16, {1, 2, 3, 4, 5, 6, 7, 8}},  // cond inf, sigma inf / 1.162
    {CoefficientType::kCans, 9, DType::kFloat32, {1, 2, 3, 4, 5, 6, 7, 8}},  // cond inf, sigma inf / 1.162
    {CoefficientType::kCans, 10, DType::kFloat16, {1, 2, 3, 4, 5, 6, 7, 8, 9}},  // cond inf, sigma inf / 1.160
    {CoefficientType::kCans, 10, DType::kBFloat16, {1, 2, 3, 4, 5, 6, 7, 8, 9}},  // cond inf, sigma inf / 1.160
    {CoefficientType::kCans, 10, DType::kFloat32, {1, 2, 3, 4, 5, 6, 7, 8, 9}},  // cond inf, sigma inf / 1.160
    {CoefficientType::kDeepseekV4, 1, DType::kFloat16, {}},  // cond 4.91, sigma 1.203 / 1.252
    {CoefficientType::kDeepseekV4, 1, DType::kBFloat16, {}},  // cond 4.91, sigma 1.204 / 1.252
    {CoefficientType::kDeepseekV4, 1, DType::kFloat32, {}},  // cond 4.91, sigma 1.203 / 1.252
    {CoefficientType::kDeepseekV4, 2, DType::kFloat16, {1}},  // cond 5.4, sigma 1.203 / 1.252
    {CoefficientType::kDeepseekV4, 2, DType::kBFloat16, {1}},  // cond 5.4, sigma 1.206 / 1.252
    {CoefficientType::kDeepseekV4, 2, DType::kFloat32, {1}},  // cond 5.4, sigma 1.203 / 1.252
    {CoefficientType::kDeepseekV4, 3, DType::kFloat16, {2}},  // cond 13.4, sigma 1.202 / 1.252
    {CoefficientType::kDeepseekV4, 3, DType::kBFloat16, {2}},  // cond 13.4, sigma 1.204 / 1.252
    {CoefficientType::kDeepseekV4, 3, DType::kFloat32, {2}},  // cond 13.4, sigma 1.202 / 1.252
    {CoefficientType::kDeepseekV4, 4, DType::kFloat16, {2}},  // cond 20.2, sigma 1.202 / 1.252
    {CoefficientType::kDeepseekV4, 4, DType::kBFloat16, {2}},  // cond 20.2, sigma 1.209 / 1.252
    {CoefficientType::kDeepseekV4, 4, DType::kFloat32, {2}},  // cond 20.2, sigma 1.202 / 1.252
    {CoefficientType::kDeepseekV4, 5, DType::kFloat16, {3}},  // cond 62.5, sigma 1.203 / 1.252
    {CoefficientType::kDeepseekV4, 5, DType::kBFloat16, {2, 3}},  // cond 19.1, sigma 1.212 / 1.252
    {CoefficientType::kDeepseekV4, 5, DType::kFloat32, {3}},  // cond 62.5, sigma 1.203 / 1.252
    {CoefficientType::kDeepseekV4, 6, DType::kFloat16, {3}},  // cond 5.28e+04, sigma 1.229 / 1.252
    {CoefficientType::kDeepseekV4, 6, DType::kBFloat16, {2, 4}},  // cond 20.2, sigma 1.239 / 1.252
    {CoefficientType::kDeepseekV4, 6, DType::kFloat32, {3}},  // cond 5.28e+04, sigma 1.208 / 1.252
    {CoefficientType::kDeepseekV4, 7, DType::kFloat16, {2, 4}},  // cond 74.1, sigma 1.246 / 1.252
    {CoefficientType::kDeepseekV4, 7, DType::kBFloat16, {2, 4, 5}},  // cond 20.2, sigma 1.236 / 1.252
    {CoefficientType::kDeepseekV4, 7, DType::kFloat32, {2, 4}},  // cond 74.1, sigma 1.231 / 1.252
    {CoefficientType::kDeepseekV4, 8, DType::kFloat16, {2, 5}},  // cond 5.28e+04, sigma 1.225 / 1.252
    {CoefficientType::kDeepseekV4, 8, DType::kBFloat16, {2, 4, 6}},  // cond 20.2, sigma 1.227 / 1.252
    {CoefficientType::kDeepseekV4, 8, DType::kFloat32, {2, 5}},  // cond 5.28e+04, sigma 1.214 / 1.252
    {CoefficientType::kDeepseekV4, 9, DType::kFloat16, {2, 4, 6}},  // cond 31, sigma 1.056 / 1.104
    {CoefficientType::kDeepseekV4, 9, DType::kBFloat16, {2, 4, 6}},  // cond 31, sigma 1.077 / 1.104
    {CoefficientType::kDeepseekV4, 9, DType::kFloat32, {2, 4, 6}},  // cond 31, sigma 1.055 / 1.104
    {CoefficientType::kDeepseekV4, 10, DType::kFloat16, {2, 4, 6}},  // cond 72.6, sigma 1.013 / 1.052
    {CoefficientType::kDeepseekV4, 10, DType::kBFloat16, {2, 4, 5, 7}},  // cond 20.2, sigma 1.017 / 1.052
    {CoefficientType::kDeepseekV4, 10, DType::kFloat32, {2, 4, 6}},  // cond 72.6, sigma 1.010 / 1.052
};
// clang-format on

}  // namespace

std::vector<int> DefaultGramRestarts(CoefficientType type, int num_steps,
                                     DType iteration_dtype) {
  if (type != CoefficientType::kCustom && num_steps <= kGramRestartTableSteps) {
    for (const GramRestartRow& row : kGramRestartTable) {
      if (row.type == type && row.num_steps == num_steps &&
          row.iteration_dtype == iteration_dtype) {
        return row.restarts;
      }
    }
  }
  if (num_steps <= 1) return {};
  if (num_steps == 2) return {1};
  std::vector<int> every_other;
  for (int i = 2; i < num_steps; i += 2) every_other.push_back(i);
  return every_other;
}

}  // namespace muond
