// The option enums of the wire API against the core enums: every core value
// has a wire value and back (the naming rule of server/common/proto_convert),
// every wire value names a core value, and UNSPECIFIED / undefined numbers are
// refused naming the field.
#include "server/common/proto_convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "core/common/domain.h"
#include "server/common/proto_convert_options.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

template <typename Core, typename Wire>
void ExpectRoundTrip(const std::vector<Core>& core_values,
                     const google::protobuf::EnumDescriptor& wire) {
  for (Core value : core_values) {
    const Wire on_wire = ToProto(value);
    EXPECT_NE(int(on_wire), 0) << wire.name() << " lacks a value";
    absl::StatusOr<Core> back = FromProto(on_wire, "field");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, value) << wire.name();
  }
  // One wire value per core value, plus UNSPECIFIED.
  EXPECT_EQ(wire.value_count(), int(core_values.size()) + 1) << wire.name();
  for (int i = 0; i < wire.value_count(); ++i) {
    const int number = wire.value(i)->number();
    if (number == 0) continue;
    EXPECT_TRUE(FromProto(Wire(number), "field").ok())
        << wire.value(i)->name() << " has no core value";
  }
  for (int bad : {0, 99}) {
    absl::StatusOr<Core> refused = FromProto(Wire(bad), "some_field");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("some_field: "));
    EXPECT_THAT(refused.status().message(), HasSubstr("is not one of"));
  }
}

TEST(ProtoConvertTest, WeightDecayMethod) {
  ExpectRoundTrip<WeightDecayMethod, v1::WeightDecayMethod>(
      {WeightDecayMethod::kDecoupled, WeightDecayMethod::kIndependent,
       WeightDecayMethod::kCautious, WeightDecayMethod::kNone},
      *v1::WeightDecayMethod_descriptor());
  EXPECT_EQ(ToProto(WeightDecayMethod::kCautious),
            v1::WEIGHT_DECAY_METHOD_CAUTIOUS);
}

TEST(ProtoConvertTest, CoefficientType) {
  ExpectRoundTrip<CoefficientType, v1::CoefficientType>(
      {CoefficientType::kSimple, CoefficientType::kQuintic,
       CoefficientType::kPolarExpress, CoefficientType::kAol,
       CoefficientType::kCans, CoefficientType::kDeepseekV4,
       CoefficientType::kCustom},
      *v1::CoefficientType_descriptor());
  EXPECT_EQ(ToProto(CoefficientType::kPolarExpress),
            v1::COEFFICIENT_TYPE_POLAR_EXPRESS);
}

TEST(ProtoConvertTest, ScaleMode) {
  ExpectRoundTrip<ScaleMode, v1::ScaleMode>(
      {ScaleMode::kSpectral, ScaleMode::kShapeScaling, ScaleMode::kUnitRmsNorm,
       ScaleMode::kOriginal, ScaleMode::kMatchRmsAdamW},
      *v1::ScaleMode_descriptor());
  EXPECT_EQ(ToProto(ScaleMode::kShapeScaling), v1::SCALE_MODE_SHAPE_SCALING);
}

TEST(ProtoConvertTest, MatmulPrecision) {
  ExpectRoundTrip<MatmulPrecision, v1::MatmulPrecision>(
      {MatmulPrecision::kHighest, MatmulPrecision::kHigh,
       MatmulPrecision::kMedium},
      *v1::MatmulPrecision_descriptor());
  EXPECT_EQ(ToProto(MatmulPrecision::kMedium), v1::MATMUL_PRECISION_MEDIUM);
}

TEST(ProtoConvertTest, NsAlgorithm) {
  ExpectRoundTrip<NsAlgorithm, v1::NsAlgorithm>(
      {NsAlgorithm::kStandard, NsAlgorithm::kGram, NsAlgorithm::kAuto},
      *v1::NsAlgorithm_descriptor());
  EXPECT_EQ(ToProto(NsAlgorithm::kGram), v1::NS_ALGORITHM_GRAM);
  EXPECT_EQ(ToProto(NsAlgorithm::kAuto), v1::NS_ALGORITHM_AUTO);
}

// The Gram iteration dtype: fp16 and bf16 both ways, nothing else.
TEST(ProtoConvertTest, GramIterDType) {
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    absl::StatusOr<DType> back = FromProto(GramDTypeToProto(t), "gram_dtype");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(GramDTypeToProto(DType::kFloat16), v1::NS_ITER_DTYPE_FP16);
  EXPECT_EQ(GramDTypeToProto(DType::kBFloat16), v1::NS_ITER_DTYPE_BF16);
  EXPECT_EQ(v1::NsIterDType_descriptor()->value_count(), 3);
  for (int bad : {0, 99}) {
    EXPECT_THAT(
        FromProto(v1::NsIterDType(bad), "gram_dtype").status().message(),
        HasSubstr("gram_dtype: "));
  }
}

// The state dtypes and locations: every core value both ways (the wire
// holds exactly those and UNSPECIFIED); UNSPECIFIED is auto (from the params)
// and the device.
TEST(ProtoConvertTest, StateDTypeAndLocation) {
  const DType fp32[] = {DType::kFloat32};
  for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3}) {
    ASSERT_TRUE(IsStateDType(t));
    absl::StatusOr<DType> back =
        StateDTypeFromProto(StateDTypeToProto(t), fp32, "state_dtype");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(v1::StateDType_descriptor()->value_count(), 4);
  const DType bf16[] = {DType::kBFloat16, DType::kBFloat16};
  EXPECT_EQ(*StateDTypeFromProto(v1::STATE_DTYPE_UNSPECIFIED, bf16, "f"),
            DType::kBFloat16);
  EXPECT_EQ(*StateDTypeFromProto(v1::STATE_DTYPE_UNSPECIFIED, fp32, "f"),
            DType::kFloat32);
  EXPECT_THAT(StateDTypeFromProto(v1::StateDType(7), fp32, "state_dtype")
                  .status()
                  .message(),
              HasSubstr("state_dtype: value 7"));
  for (StateLocation l : {StateLocation::kDevice, StateLocation::kHost}) {
    absl::StatusOr<StateLocation> back = FromProto(ToProto(l), "location");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, l);
  }
  EXPECT_EQ(v1::StateLocation_descriptor()->value_count(), 3);
  EXPECT_EQ(*FromProto(v1::STATE_LOCATION_UNSPECIFIED, "location"),
            StateLocation::kDevice);
  EXPECT_THAT(
      FromProto(v1::StateLocation(3), "state_location").status().message(),
      HasSubstr("state_location: value 3"));
}

// A param's dtype: every wire dtype names the core dtype of the same name
// (fp16 params included); UNSPECIFIED and undefined numbers are refused.
TEST(ProtoConvertTest, ParamDType) {
  for (auto [wire, core] : {std::pair{v1::DTYPE_FP32, DType::kFloat32},
                            std::pair{v1::DTYPE_BF16, DType::kBFloat16},
                            std::pair{v1::DTYPE_FP16, DType::kFloat16}}) {
    absl::StatusOr<DType> back = DTypeFromProto(wire, "ref");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, core);
  }
  EXPECT_EQ(v1::DType_descriptor()->value_count(), 4);
  for (int bad : {0, 99}) {
    EXPECT_THAT(DTypeFromProto(v1::DType(bad), "ref").status().message(),
                HasSubstr("(DTYPE_FP32, DTYPE_BF16 or DTYPE_FP16)"));
  }
}

TEST(ProtoConvertTest, CostModel) {
  ExpectRoundTrip<CostModel, v1::CostModel>({kNsCost, kFlops, kMeasured},
                                            *v1::CostModel_descriptor());
  EXPECT_EQ(ToProto(kMeasured), v1::COST_MODEL_MEASURED);
  EXPECT_EQ(ParseCostModel("flops").value(), kFlops);
  EXPECT_THAT(ParseCostModel("magic", "--cost-model").status().message(),
              HasSubstr("--cost-model: 'magic' is not one of"));
}

// The DP axis on the wire: dp_size 0 (unset) reads as 1, the home replica
// travels both ways.
TEST(ProtoConvertTest, DomainDpAxisAndHomeReplica) {
  v1::Domain domain;
  domain.set_gtp_size(2);
  domain.set_tp_size(3);
  EXPECT_EQ(DomainSizeOf(domain).dp, 1);
  domain.set_dp_size(4);
  const DomainSize size = DomainSizeOf(domain);
  EXPECT_EQ(size.gtp, 2);
  EXPECT_EQ(size.tp, 3);
  EXPECT_EQ(size.dp, 4);
  EXPECT_EQ(size.all_ranks(), 24);
  const NsHome home{1, 2, 3};
  const v1::NsHome wire = ToProto(home);
  EXPECT_EQ(wire.d(), 3);
  EXPECT_EQ(FromProto(wire), home);
}

TEST(CheckDomainCoordinates, ReplicaInsideTheDpAxis) {
  const DomainSize size{2, 1, 3};
  EXPECT_TRUE(CheckDomainCoordinates(size, 2, 1, 0, "here").ok());
  const absl::Status outside = CheckDomainCoordinates(size, 3, 0, 0, "here");
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outside.message(), "here: replica d=3 lies outside dp_size 3");
  EXPECT_THAT(CheckDomainCoordinates(size, 0, 2, 0, "here").message(),
              HasSubstr("(g=2, t=0) lies outside 2x1"));
  EXPECT_THAT(
      CheckDomainCoordinates(DomainSize{1, 1, 0}, 0, 0, 0, "here").message(),
      HasSubstr("here: dp_size 0 must be >= 1"));
}

// A DDP group's plan: one home replica per matrix, a load per domain rank.
TEST(PlanGroup, DpDomainHomesAndRankLoad) {
  v1::GroupManifest manifest;
  manifest.set_group("g");
  manifest.mutable_domain()->set_name("dense");
  manifest.mutable_domain()->set_gtp_size(1);
  manifest.mutable_domain()->set_tp_size(1);
  manifest.mutable_domain()->set_dp_size(2);
  manifest.mutable_domain()->set_d(1);
  for (int i = 0; i < 4; ++i) {
    v1::ParamSpec* p = manifest.add_params();
    p->set_name("w" + std::to_string(i));
    for (int64_t dim : {16, 8}) {
      p->add_full_shape(dim);
      p->add_local_shape(dim);
    }
  }
  absl::StatusOr<v1::GroupPlan> plan =
      PlanGroup(manifest, v1::COST_MODEL_NS_COST, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->rank_load_size(), 2);
  EXPECT_EQ(plan->rank_load(0), plan->rank_load(1));
  std::vector<int> per_replica(2, 0);
  for (const v1::NsHome& h : plan->homes()) ++per_replica[h.d()];
  EXPECT_EQ(per_replica, (std::vector<int>{2, 2}));
}

}  // namespace
}  // namespace muond
