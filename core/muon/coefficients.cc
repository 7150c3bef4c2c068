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
  std::initializer_list<int> restarts;
};

// Generated by
//   python3 tools/gram_restart_tuner.py --max-steps 10
// (sigma = logspace(0, -10, 10000), Gram eigenvalues perturbed by -4e-4, the
// fewest restarts >= 1 whose best placement keeps cond(Q) < 1e8; the tuner's
// docstring has the rule). tests/tools/gram_restart_tuner_test.py reruns it
// against this table. cans past 5 steps repeats a tuple that is not a fixed
// point at sigma = 1 and diverges on any algorithm; the rule then restarts
// every iteration.
const GramRestartRow kGramRestartTable[] = {
    {CoefficientType::kSimple, 1, {}},                      // cond(Q) 4.91
    {CoefficientType::kSimple, 2, {1}},                     // cond(Q) 5.4
    {CoefficientType::kSimple, 3, {2}},                     // cond(Q) 13.4
    {CoefficientType::kSimple, 4, {2}},                     // cond(Q) 20.2
    {CoefficientType::kSimple, 5, {3}},                     // cond(Q) 62.5
    {CoefficientType::kSimple, 6, {2}},                     // cond(Q) 668
    {CoefficientType::kSimple, 7, {2}},                     // cond(Q) 4.47e+06
    {CoefficientType::kSimple, 8, {2, 4}},                  // cond(Q) 668
    {CoefficientType::kSimple, 9, {2, 4}},                  // cond(Q) 4.47e+06
    {CoefficientType::kSimple, 10, {2, 4, 6}},              // cond(Q) 668
    {CoefficientType::kQuintic, 1, {}},                     // cond(Q) 34.8
    {CoefficientType::kQuintic, 2, {1}},                    // cond(Q) 34.8
    {CoefficientType::kQuintic, 3, {1}},                    // cond(Q) 34.8
    {CoefficientType::kQuintic, 4, {2}},                    // cond(Q) 53.2
    {CoefficientType::kQuintic, 5, {2}},                    // cond(Q) 53.2
    {CoefficientType::kQuintic, 6, {2}},                    // cond(Q) 4.6e+03
    {CoefficientType::kQuintic, 7, {2}},                    // cond(Q) 1.86e+06
    {CoefficientType::kQuintic, 8, {2, 5}},                 // cond(Q) 198
    {CoefficientType::kQuintic, 9, {2, 5}},                 // cond(Q) 1.3e+03
    {CoefficientType::kQuintic, 10, {2, 5, 7}},             // cond(Q) 167
    {CoefficientType::kPolarExpress, 1, {}},                // cond(Q) 34.3
    {CoefficientType::kPolarExpress, 2, {1}},               // cond(Q) 34.3
    {CoefficientType::kPolarExpress, 3, {1}},               // cond(Q) 170
    {CoefficientType::kPolarExpress, 4, {2}},               // cond(Q) 172
    {CoefficientType::kPolarExpress, 5, {1}},               // cond(Q) 631
    {CoefficientType::kPolarExpress, 6, {1}},               // cond(Q) 2.29e+05
    {CoefficientType::kPolarExpress, 7, {1, 3}},            // cond(Q) 170
    {CoefficientType::kPolarExpress, 8, {1, 3}},            // cond(Q) 170
    {CoefficientType::kPolarExpress, 9, {1, 4}},            // cond(Q) 246
    {CoefficientType::kPolarExpress, 10, {1, 4}},           // cond(Q) 3.47e+04
    {CoefficientType::kAol, 1, {}},                         // cond(Q) 826
    {CoefficientType::kAol, 2, {1}},                        // cond(Q) 826
    {CoefficientType::kAol, 3, {1}},                        // cond(Q) 826
    {CoefficientType::kAol, 4, {1}},                        // cond(Q) 826
    {CoefficientType::kAol, 5, {3}},                        // cond(Q) 1.49e+03
    {CoefficientType::kAol, 6, {3}},                        // cond(Q) 1.61e+03
    {CoefficientType::kAol, 7, {3}},                        // cond(Q) 3.28e+03
    {CoefficientType::kAol, 8, {3}},                        // cond(Q) 7.89e+05
    {CoefficientType::kAol, 9, {3, 6}},                     // cond(Q) 1.63e+03
    {CoefficientType::kAol, 10, {3, 6}},                    // cond(Q) 2.85e+03
    {CoefficientType::kCans, 1, {}},                        // cond(Q) 822
    {CoefficientType::kCans, 2, {1}},                       // cond(Q) 822
    {CoefficientType::kCans, 3, {1}},                       // cond(Q) 822
    {CoefficientType::kCans, 4, {1}},                       // cond(Q) 822
    {CoefficientType::kCans, 5, {1}},                       // cond(Q) 7.24e+04
    {CoefficientType::kCans, 6, {1, 2, 3, 4, 5}},           // cond(Q) 1.05e+19
    {CoefficientType::kCans, 7, {1, 2, 3, 4, 5, 6}},        // cond(Q) 2.24e+94
    {CoefficientType::kCans, 8, {1, 2, 3, 4, 5, 6, 7}},     // cond(Q) inf
    {CoefficientType::kCans, 9, {1, 2, 3, 4, 5, 6, 7, 8}},  // cond(Q) inf
    {CoefficientType::kCans, 10, {1, 2, 3, 4, 5, 6, 7, 8, 9}},  // cond(Q) inf
    {CoefficientType::kDeepseekV4, 1, {}},                      // cond(Q) 4.91
    {CoefficientType::kDeepseekV4, 2, {1}},                     // cond(Q) 5.4
    {CoefficientType::kDeepseekV4, 3, {2}},                     // cond(Q) 13.4
    {CoefficientType::kDeepseekV4, 4, {2}},                     // cond(Q) 20.2
    {CoefficientType::kDeepseekV4, 5, {3}},                     // cond(Q) 62.5
    {CoefficientType::kDeepseekV4, 6, {2}},                     // cond(Q) 668
    {CoefficientType::kDeepseekV4, 7, {2}},         // cond(Q) 4.47e+06
    {CoefficientType::kDeepseekV4, 8, {2, 4}},      // cond(Q) 668
    {CoefficientType::kDeepseekV4, 9, {2, 4}},      // cond(Q) 8.17e+05
    {CoefficientType::kDeepseekV4, 10, {2, 4, 6}},  // cond(Q) 72.6
};

}  // namespace

std::vector<int> DefaultGramRestarts(CoefficientType type, int num_steps) {
  if (type != CoefficientType::kCustom && num_steps <= kGramRestartTableSteps) {
    for (const GramRestartRow& row : kGramRestartTable) {
      if (row.type == type && row.num_steps == num_steps) return row.restarts;
    }
  }
  if (num_steps <= 1) return {};
  if (num_steps == 2) return {1};
  std::vector<int> every_other;
  for (int i = 2; i < num_steps; i += 2) every_other.push_back(i);
  return every_other;
}

}  // namespace muond
