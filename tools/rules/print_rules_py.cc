// Prints client/python/muond/_rules.py: the constants the Python client
// shares with the daemon, each read from its C++ home, so that the client
// cannot drift from the daemon it talks to. tests/rules:rules_py_fresh_test
// fails when the committed module differs from this program's output.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/common/dtype.h"
#include "core/common/error_reason.h"
#include "core/muon/bounds.h"
#include "core/muon/coefficients.h"
#include "core/muon/muon_update.h"
#include "core/muon/muon_variant.h"
#include "core/muon/newton_schulz.h"
#include "proto/step_channel_layout.h"
#include "server/common/job_id.h"
#include "server/common/operator_id.h"
#include "server/common/step_id.h"
#include "server/common/unix_socket.h"
#include "tools/rules/python_literal.h"

namespace muond::rules {
namespace {

struct Constant {
  std::string name;
  std::string literal;  // Python source
  std::string home;     // the C++ definition it is read from
};

// The names of an enum's values 0, 1, ... as long as `parse` maps each name
// back to its value: the list a parser accepts, in enum order, without
// repeating its length here.
template <typename Enum, typename NameFn, typename ParseFn>
std::vector<std::string> EnumNames(NameFn name, ParseFn parse) {
  std::vector<std::string> names;
  for (int i = 0;; ++i) {
    const Enum value = static_cast<Enum>(i);
    const std::string text(name(value));
    const auto parsed = parse(text);
    if (!parsed.ok() || *parsed != value) return names;
    names.push_back(text);
  }
}

std::vector<std::string> ErrorReasonNames() {
  std::vector<std::string> names;
  const absl::string_view unspecified =
      ErrorReasonName(ErrorReason::kUnspecified);
  // Reasons are dense from 1; past the last one the name is "unspecified".
  for (int i = 1;; ++i) {
    const absl::string_view name = ErrorReasonName(static_cast<ErrorReason>(i));
    if (name == unspecified) return names;
    names.emplace_back(name);
  }
}

// The Gram NS iteration dtypes ParseGramDType accepts, the default first.
std::vector<std::string> GramDTypeNames() {
  std::vector<std::string> names;
  for (DType t : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    if (ParseGramDType(DTypeName(t)).ok()) names.emplace_back(DTypeName(t));
  }
  return names;
}

std::string SimpleCoefficients() {
  const NsCoefficients& t = BuiltinCoefficients(CoefficientType::kSimple)[0];
  return PyTuple({PyFloat32(t.a), PyFloat32(t.b), PyFloat32(t.c)});
}

std::vector<Constant> WireConstants() {
  return {
      {"ERROR_DOMAIN", PyStr(std::string(kErrorDomain)),
       "core/common/error_reason.h kErrorDomain"},
      {"ERROR_REASONS", PyStrTuple(ErrorReasonNames()),
       "core/common/error_reason.h ErrorReasonName"},
      {"OPERATOR_ID_PREFIX", PyStr(kOperatorIdPrefix),
       "server/common/operator_id.h kOperatorIdPrefix"},
      {"OPERATOR_ID_LABEL", PyStr(kOperatorIdLabel),
       "server/common/operator_id.h kOperatorIdLabel"},
      {"MAX_JOB_ID_CHARS", PyInt(kMaxJobIdChars),
       "server/common/job_id.h kMaxJobIdChars"},
      {"MAX_UNIX_SOCKET_PATH_BYTES", PyInt(int64_t(MaxUnixSocketPathBytes())),
       "server/common/unix_socket.h MaxUnixSocketPathBytes"},
      {"MAX_STEP_ID", PyInt(kMaxStepId), "server/common/step_id.h kMaxStepId"},
  };
}

std::vector<Constant> OptionNameConstants() {
  return {
      {"COEFFICIENT_TYPES",
       PyStrTuple(EnumNames<CoefficientType>(CoefficientTypeName,
                                             ParseCoefficientType)),
       "core/muon/coefficients.h CoefficientTypeName"},
      {"SCALE_MODES",
       PyStrTuple(EnumNames<ScaleMode>(ScaleModeName, ParseScaleMode)),
       "core/muon/muon_update.h ScaleModeName"},
      {"WEIGHT_DECAY_METHODS",
       PyStrTuple(EnumNames<WeightDecayMethod>(WeightDecayMethodName,
                                               ParseWeightDecayMethod)),
       "core/backend/backend.h WeightDecayMethodName"},
      {"MATMUL_PRECISIONS",
       PyStrTuple(EnumNames<MatmulPrecision>(MatmulPrecisionName,
                                             ParseMatmulPrecision)),
       "core/backend/backend.h MatmulPrecisionName (fp32_matmul_prec)"},
      {"NS_ALGORITHMS",
       PyStrTuple(EnumNames<NsAlgorithm>(NsAlgorithmName, ParseNsAlgorithm)),
       "core/muon/newton_schulz.h NsAlgorithmName"},
      {"GRAM_DTYPES", PyStrTuple(GramDTypeNames()),
       "core/muon/newton_schulz.h ParseGramDType"},
      {"MUON_VARIANTS",
       PyStrTuple(EnumNames<MuonVariant>(MuonVariantName, ParseMuonVariant)),
       "core/muon/muon_variant.h MuonVariantName"},
  };
}

std::vector<Constant> MathConstants() {
  const NsOptions ns;
  return {
      {"SIMPLE_COEFFICIENTS", SimpleCoefficients(),
       "core/muon/coefficients.h BuiltinCoefficients(kSimple)"},
      {"DEFAULT_NS_ALGORITHM", PyStr(NsAlgorithmName(ns.algorithm)),
       "core/muon/newton_schulz.h NsOptions::algorithm"},
      {"DEFAULT_GRAM_DTYPE", PyStr(DTypeName(ns.gram_dtype)),
       "core/muon/newton_schulz.h NsOptions::gram_dtype"},
      {"DEFAULT_GRAM_MIN_ASPECT_RATIO", PyFloat(ns.gram_min_aspect_ratio),
       "core/muon/newton_schulz.h NsOptions::gram_min_aspect_ratio"},
      // torch's adjust_lr_fn="match_rms_adamw" is muond's spectral scale
      // times this factor (MuonShapeScale of the two modes).
      {"MATCH_RMS_ADAMW_EXTRA_SCALE",
       PyFloat(MuonShapeScale(ScaleMode::kMatchRmsAdamW, 1, 1) /
               MuonShapeScale(ScaleMode::kSpectral, 1, 1)),
       "core/muon/muon_update.h MuonShapeScale"},
      {"MAX_LR", PyFloat(kMaxLr), "core/muon/bounds.h kMaxLr"},
      {"MAX_WEIGHT_DECAY", PyFloat(kMaxWeightDecay),
       "core/muon/bounds.h kMaxWeightDecay"},
      {"MAX_EXTRA_SCALE_FACTOR", PyFloat(kMaxExtraScaleFactor),
       "core/muon/bounds.h kMaxExtraScaleFactor"},
      {"MAX_NS_STEPS", PyInt(kMaxNsSteps), "core/muon/bounds.h kMaxNsSteps"},
  };
}

// The step channel's layout, for the trainer's end of it
// (muond/step_channel.py); ResponseOffset is kRequestOffset plus the request
// capacity, which the client adds itself.
std::vector<Constant> StepChannelConstants() {
  namespace sc = step_channel;
  const std::string home = "proto/step_channel_layout.h ";
  const auto u64 = [](uint64_t v) { return PyInt(static_cast<int64_t>(v)); };
  return {
      {"STEP_CHANNEL_MAGIC", u64(sc::kMagic), home + "kMagic"},
      {"STEP_CHANNEL_VERSION", u64(sc::kVersion), home + "kVersion"},
      {"STEP_CHANNEL_MAGIC_OFFSET", u64(sc::kMagicOffset),
       home + "kMagicOffset"},
      {"STEP_CHANNEL_VERSION_OFFSET", u64(sc::kVersionOffset),
       home + "kVersionOffset"},
      {"STEP_CHANNEL_REQUEST_CAPACITY_OFFSET", u64(sc::kRequestCapacityOffset),
       home + "kRequestCapacityOffset"},
      {"STEP_CHANNEL_RESPONSE_CAPACITY_OFFSET",
       u64(sc::kResponseCapacityOffset), home + "kResponseCapacityOffset"},
      {"STEP_CHANNEL_REQUEST_SEQ_OFFSET", u64(sc::kRequestSeqOffset),
       home + "kRequestSeqOffset"},
      {"STEP_CHANNEL_RESPONSE_SEQ_OFFSET", u64(sc::kResponseSeqOffset),
       home + "kResponseSeqOffset"},
      {"STEP_CHANNEL_REQUEST_LEN_OFFSET", u64(sc::kRequestLenOffset),
       home + "kRequestLenOffset"},
      {"STEP_CHANNEL_REQUEST_OP_OFFSET", u64(sc::kRequestOpOffset),
       home + "kRequestOpOffset"},
      {"STEP_CHANNEL_RESPONSE_LEN_OFFSET", u64(sc::kResponseLenOffset),
       home + "kResponseLenOffset"},
      {"STEP_CHANNEL_RESPONSE_KIND_OFFSET", u64(sc::kResponseKindOffset),
       home + "kResponseKindOffset"},
      {"STEP_CHANNEL_REQUEST_OFFSET", u64(sc::kRequestOffset),
       home + "kRequestOffset"},
      {"STEP_CHANNEL_TRAINER_LOCK_BYTE", u64(sc::kTrainerLockByte),
       home + "kTrainerLockByte"},
      {"STEP_CHANNEL_DAEMON_LOCK_BYTE", u64(sc::kDaemonLockByte),
       home + "kDaemonLockByte"},
      {"STEP_CHANNEL_MIN_CAPACITY", u64(sc::kMinCapacity),
       home + "kMinCapacity"},
      {"STEP_CHANNEL_MAX_CAPACITY", u64(sc::kMaxCapacity),
       home + "kMaxCapacity"},
      {"STEP_CHANNEL_OP_STEP", u64(sc::kOpStep), home + "kOpStep"},
      {"STEP_CHANNEL_OP_CLOSE", u64(sc::kOpClose), home + "kOpClose"},
      {"STEP_CHANNEL_STEP_RESPONSE", u64(sc::kStepResponse),
       home + "kStepResponse"},
      {"STEP_CHANNEL_RPC_STATUS", u64(sc::kRpcStatus), home + "kRpcStatus"},
      {"STEP_CHANNEL_TOO_LARGE", u64(sc::kTooLarge), home + "kTooLarge"},
      {"STEP_CHANNEL_VERDICT_SEQ_OFFSET", u64(sc::kVerdictSeqOffset),
       home + "kVerdictSeqOffset"},
      {"STEP_CHANNEL_VERDICT_OFFSET", u64(sc::kVerdictOffset),
       home + "kVerdictOffset"},
      {"STEP_CHANNEL_VERDICT_GO", u64(sc::kVerdictGo), home + "kVerdictGo"},
      {"STEP_CHANNEL_VERDICT_WITHDRAW", u64(sc::kVerdictWithdraw),
       home + "kVerdictWithdraw"},
  };
}

constexpr char kHeader[] =
    "# Generated by tools/rules/print_rules_py.cc. Do not edit.\n"
    "# Regenerate from the workspace root:\n"
    "#   bazel run //tools/rules:print_rules_py > "
    "client/python/muond/_rules.py\n"
    "\"\"\"The constants the Python client shares with the daemon, each "
    "read from its\n"
    "C++ home (named above it), so the two cannot drift apart.\"\"\"\n";

void Print(const std::vector<Constant>& constants) {
  for (const Constant& c : constants) {
    std::printf("\n# %s\n%s = %s\n", c.home.c_str(), c.name.c_str(),
                c.literal.c_str());
  }
}

}  // namespace
}  // namespace muond::rules

int main() {
  std::fputs(muond::rules::kHeader, stdout);
  muond::rules::Print(muond::rules::WireConstants());
  muond::rules::Print(muond::rules::OptionNameConstants());
  muond::rules::Print(muond::rules::MathConstants());
  muond::rules::Print(muond::rules::StepChannelConstants());
  return 0;
}
