#pragma once
// The Muon option enums of the wire (MuonHyperparams) <-> core/muon and
// core/backend. A wire value is named by the rule of wire_enum.h (the enum's
// prefix + the core name in upper case). FromProto: InvalidArgument naming
// `field` for *_UNSPECIFIED (callers test it first: it means the core
// default) and for numbers the enum does not define. ToProto never fails
// (tests/server/common/proto_convert_test checks every core value has a wire
// value).
// Separate from proto_convert so the coordinator and the fuzzer do not link
// the Muon math.
#include <span>
#include <string_view>

#include "absl/status/statusor.h"
#include "core/backend/backend.h"
#include "core/common/state_options.h"
#include "core/muon/adamw.h"
#include "core/muon/coefficients.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "muond/v1/muond.pb.h"

namespace muond {

absl::StatusOr<WeightDecayMethod> FromProto(v1::WeightDecayMethod method,
                                            std::string_view field);
absl::StatusOr<CoefficientType> FromProto(v1::CoefficientType type,
                                          std::string_view field);
absl::StatusOr<ScaleMode> FromProto(v1::ScaleMode mode, std::string_view field);
absl::StatusOr<MatmulPrecision> FromProto(v1::MatmulPrecision precision,
                                          std::string_view field);
absl::StatusOr<NsAlgorithm> FromProto(v1::NsAlgorithm algorithm,
                                      std::string_view field);
// Gram NS iteration dtype: NS_ITER_DTYPE_FP16 / _BF16 <-> DType kFloat16 /
// kBFloat16 (fp16 exists on the wire only here, as an iteration dtype).
absl::StatusOr<DType> FromProto(v1::NsIterDType dtype, std::string_view field);
// A group's state dtype: STATE_DTYPE_UNSPECIFIED is auto, the dtype
// AutoStateDType (core/common/state_storage.h) gives `param_dtypes` (the
// group's params); unknown numbers InvalidArgument naming `field`.
absl::StatusOr<DType> StateDTypeFromProto(v1::StateDType dtype,
                                          std::span<const DType> param_dtypes,
                                          std::string_view field);
// STATE_LOCATION_UNSPECIFIED is kDevice.
absl::StatusOr<StateLocation> FromProto(v1::StateLocation location,
                                        std::string_view field);
v1::WeightDecayMethod ToProto(WeightDecayMethod method);
v1::CoefficientType ToProto(CoefficientType type);
v1::ScaleMode ToProto(ScaleMode mode);
v1::MatmulPrecision ToProto(MatmulPrecision precision);
v1::NsAlgorithm ToProto(NsAlgorithm algorithm);
// kFloat16 or kBFloat16 (ValidateGramOptions refuses the others).
v1::NsIterDType GramDTypeToProto(DType dtype);
// kFloat32, kBFloat16 or kFloat8E4M3 (IsStateDType).
v1::StateDType StateDTypeToProto(DType dtype);
v1::StateLocation ToProto(StateLocation location);

// Proto hyperparameters -> core options; unset optional fields and
// *_UNSPECIFIED enums take the documented defaults (num_ns_steps 5, eps
// 1e-15, extra_scale_factor 1, ns_batch_size 0 (auto), quintic, spectral, decoupled,
// highest, device state); set ones are validated as given. state_dtype
// UNSPECIFIED (auto) takes its dtype from the group's params: those of
// `group.params`, or `param_dtypes` where the caller has bound them (the
// daemon clears a registered group's params).
absl::StatusOr<MuonOptions> MuonOptionsFromProto(const v1::ParamGroup& group);
absl::StatusOr<MuonOptions> MuonOptionsFromProto(
    const v1::ParamGroup& group, std::span<const DType> param_dtypes);
absl::StatusOr<AdamWOptions> AdamWOptionsFromProto(const v1::ParamGroup& group);
absl::StatusOr<AdamWOptions> AdamWOptionsFromProto(
    const v1::ParamGroup& group, std::span<const DType> param_dtypes);

}  // namespace muond
