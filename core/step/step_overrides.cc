#include "core/step/step_overrides.h"

#include <optional>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "core/common/echo.h"
#include "core/common/status_macros.h"

namespace muond {

namespace {

// The group `name` of an override, or InvalidArgument naming it.
absl::StatusOr<Algorithm> OverriddenGroup(
    const std::string& name, const std::map<std::string, Algorithm>& groups) {
  auto it = groups.find(name);
  if (it == groups.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("overrides: unknown group '", Echo(name), "'"));
  }
  return it->second;
}

// One overridable field: its name, the algorithm it belongs to, its values
// and the bound check (core/muon/bounds.h; null: a bool, nothing to check).
struct OverrideField {
  const char* field;
  std::optional<Algorithm> only;  // nullopt: both algorithms
  const std::map<std::string, double>* values;
  absl::Status (*check)(double, std::string_view);
};

// "overrides: group 'g' lr -1 must be finite, >= 0 and <= 1000".
absl::Status CheckUpTo(double value, double bound, std::string_view what) {
  // !(v >= 0) is true for NaN too.
  if (!(value >= 0) || !(value <= bound)) {
    return absl::InvalidArgumentError(absl::StrCat(
        std::string(what), " ", value, " must be finite, >= 0 and <= ", bound));
  }
  return absl::OkStatus();
}
absl::Status CheckLrOverride(double v, std::string_view what) {
  return CheckUpTo(v, kMaxOverrideLr, what);
}
absl::Status CheckWeightDecayOverride(double v, std::string_view what) {
  return CheckUpTo(v, kMaxOverrideWeightDecay, what);
}

absl::Status CheckOverrideField(
    const OverrideField& f, const std::map<std::string, Algorithm>& groups) {
  for (const auto& [name, value] : *f.values) {
    ASSIGN_OR_RETURN(const Algorithm algorithm, OverriddenGroup(name, groups));
    const std::string what =
        absl::StrCat("overrides: group '", Echo(name), "' ", f.field);
    if (f.only.has_value() && *f.only != algorithm) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is ", *f.only == Algorithm::kMuon ? "a Muon" : "an AdamW",
          " hyperparameter; the group is ",
          algorithm == Algorithm::kMuon ? "a Muon" : "an AdamW", " group"));
    }
    RETURN_IF_ERROR(f.check(value, what));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckStepOverrides(
    const StepOverrides& o, const std::map<std::string, Algorithm>& groups) {
  const OverrideField fields[] = {
      {"lr", std::nullopt, &o.lr, CheckLrOverride},
      {"weight_decay", std::nullopt, &o.weight_decay, CheckWeightDecayOverride},
      {"momentum", Algorithm::kMuon, &o.momentum, CheckUnitInterval},
      {"beta1", Algorithm::kAdamW, &o.beta1, CheckUnitInterval},
      {"beta2", Algorithm::kAdamW, &o.beta2, CheckUnitInterval},
      {"eps", Algorithm::kAdamW, &o.eps, CheckPositiveFloat32},
  };
  for (const OverrideField& f : fields) {
    RETURN_IF_ERROR(CheckOverrideField(f, groups));
  }
  // nesterov has no bound, only an algorithm.
  std::map<std::string, double> nesterov;
  for (const auto& [name, on] : o.nesterov) nesterov[name] = on ? 1.0 : 0.0;
  return CheckOverrideField(
      {"nesterov", Algorithm::kMuon, &nesterov,
       [](double, std::string_view) { return absl::OkStatus(); }},
      groups);
}

absl::Status CheckSkipParams(
    const std::set<std::string>& skip,
    const std::function<bool(const std::string&)>& held) {
  for (const std::string& name : skip) {
    if (held(name)) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "skip_params: '", Echo(name),
        "' names no param this daemon holds (a skipped param must be one "
        "registered on this rank); the step was not applied"));
  }
  return absl::OkStatus();
}

namespace {

template <typename T>
void Override(const std::map<std::string, T>& values, const std::string& group,
              T& field) {
  if (auto it = values.find(group); it != values.end()) field = it->second;
}

}  // namespace

MuonOptions MuonOptionsForStep(MuonOptions options, const std::string& group,
                               const StepOverrides& o) {
  Override(o.lr, group, options.lr);
  Override(o.weight_decay, group, options.weight_decay);
  Override(o.momentum, group, options.momentum);
  Override(o.nesterov, group, options.nesterov);
  return options;
}

AdamWOptions AdamWOptionsForStep(AdamWOptions options, const std::string& group,
                                 const StepOverrides& o) {
  Override(o.lr, group, options.lr);
  Override(o.weight_decay, group, options.weight_decay);
  Override(o.beta1, group, options.beta1);
  Override(o.beta2, group, options.beta2);
  Override(o.eps, group, options.eps);
  return options;
}

}  // namespace muond
