// The option enums of the wire API against the core enums: every core value
// has a wire value and back (the naming rule of server/common/proto_convert),
// every wire value names a core value, and UNSPECIFIED / undefined numbers are
// refused naming the field.
#include "server/common/proto_convert.h"
#include "server/common/proto_convert_options.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

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

TEST(ProtoConvertTest, CostModel) {
  ExpectRoundTrip<CostModel, v1::CostModel>({kNsCost, kFlops, kMeasured},
                                            *v1::CostModel_descriptor());
  EXPECT_EQ(ToProto(kMeasured), v1::COST_MODEL_MEASURED);
  EXPECT_EQ(ParseCostModel("flops").value(), kFlops);
  EXPECT_THAT(ParseCostModel("magic", "--cost-model").status().message(),
              HasSubstr("--cost-model: 'magic' is not one of"));
}

}  // namespace
}  // namespace muond
