// Group hyperparameters a client sends explicitly
// are validated as given (unset = the core default, set = checked), bounded
// by core/muon/bounds.h, and eps values are checked in fp32, the precision
// the kernels use them in.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/daemon/engine_factory.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

v1::ParamGroup MuonGroup() {
  v1::ParamGroup g;
  g.set_name("g");
  g.set_algorithm(v1::ALGORITHM_MUON);
  g.mutable_muon()->set_lr(0.02);
  g.mutable_muon()->set_momentum(0.95);
  return g;
}

v1::ParamGroup AdamWGroup() {
  v1::ParamGroup g;
  g.set_name("a");
  g.set_algorithm(v1::ALGORITHM_ADAMW);
  g.mutable_adamw()->set_lr(1e-3);
  return g;
}

void ExpectMuonRefused(void (*set)(v1::MuonHyperparams*),
                       const std::string& field, const std::string& value) {
  v1::ParamGroup g = MuonGroup();
  set(g.mutable_muon());
  absl::StatusOr<MuonOptions> o = MuonOptionsFromProto(g);
  ASSERT_FALSE(o.ok()) << field;
  EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o.status().message(), HasSubstr("group 'g'"));
  EXPECT_THAT(o.status().message(), HasSubstr(field));
  EXPECT_THAT(o.status().message(), HasSubstr("got " + value));
}

TEST(GroupOptions, UnsetFieldsTakeTheDefaults) {
  absl::StatusOr<MuonOptions> o = MuonOptionsFromProto(MuonGroup());
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->ns_batch_size, 0);  // auto
  EXPECT_EQ(o->ns.num_steps, 5);
  EXPECT_EQ(o->extra_scale_factor, 1.0);
  EXPECT_FALSE(o->double_buffer_momentum);
  EXPECT_TRUE(AdamWOptionsFromProto(AdamWGroup()).ok());
}

TEST(GroupOptions, DoubleBufferMomentumIsTaken) {
  v1::ParamGroup g = MuonGroup();
  g.mutable_muon()->set_double_buffer_momentum(true);
  absl::StatusOr<MuonOptions> o = MuonOptionsFromProto(g);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_TRUE(o->double_buffer_momentum);
}

TEST(GroupOptions, ExplicitOutOfRangeValuesAreRefusedNotDefaulted) {
  ExpectMuonRefused([](auto* h) { h->set_ns_batch_size(-1); }, "ns_batch_size",
                    "-1");
  ExpectMuonRefused([](auto* h) { h->set_num_ns_steps(0); }, "num_steps", "0");
  ExpectMuonRefused([](auto* h) { h->set_extra_scale_factor(0.0); },
                    "extra_scale_factor", "0");
}

TEST(GroupOptions, HugeValuesAreRefused) {
  ExpectMuonRefused([](auto* h) { h->set_num_ns_steps(100); }, "num_steps",
                    "100");
  ExpectMuonRefused([](auto* h) { h->set_extra_scale_factor(1e30); },
                    "extra_scale_factor", "1e+30");
  ExpectMuonRefused([](auto* h) { h->set_lr(1e30); }, "muon lr", "1e+30");
  ExpectMuonRefused([](auto* h) { h->set_weight_decay(1e30); },
                    "muon weight_decay", "1e+30");
  v1::ParamGroup a = AdamWGroup();
  a.mutable_adamw()->set_lr(kMaxLr * 2);
  EXPECT_THAT(AdamWOptionsFromProto(a).status().message(),
              HasSubstr("adamw lr must be finite and in [0, 1000]"));
  a = AdamWGroup();
  a.mutable_adamw()->set_weight_decay(1e30);
  EXPECT_THAT(AdamWOptionsFromProto(a).status().message(),
              HasSubstr("adamw weight_decay"));
  // The bounds themselves are accepted.
  v1::ParamGroup g = MuonGroup();
  g.mutable_muon()->set_lr(kMaxLr);
  g.mutable_muon()->set_weight_decay(kMaxWeightDecay);
  g.mutable_muon()->set_extra_scale_factor(kMaxExtraScaleFactor);
  g.mutable_muon()->set_num_ns_steps(kMaxNsSteps);
  EXPECT_TRUE(MuonOptionsFromProto(g).ok()) << MuonOptionsFromProto(g).status();
}

TEST(GroupOptions, EpsIsValidatedAsAFloat32AndEchoedAsGiven) {
  // 1e-300 is a positive double but 0 in fp32: refused, and the message shows
  // the value sent, not "got 0".
  ExpectMuonRefused([](auto* h) { h->set_eps(1e-300); }, "muon eps", "1e-300");
  ExpectMuonRefused([](auto* h) { h->set_eps(1e300); }, "muon eps", "1e+300");
  v1::ParamGroup a = AdamWGroup();
  a.mutable_adamw()->set_eps(1e-300);
  const absl::Status st = AdamWOptionsFromProto(a).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("adamw eps"));
  EXPECT_THAT(st.message(), HasSubstr("got 1e-300"));
  a.mutable_adamw()->set_eps(1e-12);
  EXPECT_TRUE(AdamWOptionsFromProto(a).ok());
}

// The Gram NS fields travel to NsOptions; unset ones keep the
// defaults; bad values are refused naming the group, the field and the rule.
TEST(GroupOptions, GramFieldsReachNsOptions) {
  absl::StatusOr<MuonOptions> d = MuonOptionsFromProto(MuonGroup());
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ns.algorithm, NsAlgorithm::kAuto);  // unspecified = auto
  EXPECT_FALSE(d->ns.gram_restarts.has_value());
  EXPECT_EQ(d->ns.gram_dtype, DType::kFloat16);
  EXPECT_EQ(d->ns.gram_min_aspect_ratio, 0.0);

  v1::ParamGroup g = MuonGroup();
  v1::MuonHyperparams* h = g.mutable_muon();
  h->set_ns_algorithm(v1::NS_ALGORITHM_GRAM);
  h->mutable_gram_restarts()->add_iterations(1);
  h->mutable_gram_restarts()->add_iterations(3);
  h->set_gram_dtype(v1::NS_ITER_DTYPE_BF16);
  h->set_gram_min_aspect_ratio(2.5);
  absl::StatusOr<MuonOptions> o = MuonOptionsFromProto(g);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->ns.algorithm, NsAlgorithm::kGram);
  EXPECT_EQ(o->ns.gram_restarts, (std::vector<int>{1, 3}));
  EXPECT_EQ(o->ns.gram_dtype, DType::kBFloat16);
  EXPECT_EQ(o->ns.gram_min_aspect_ratio, 2.5);

  // A set but empty list is "no restart", not the default.
  h->mutable_gram_restarts()->clear_iterations();
  o = MuonOptionsFromProto(g);
  ASSERT_TRUE(o.ok());
  ASSERT_TRUE(o->ns.gram_restarts.has_value());
  EXPECT_TRUE(o->ns.gram_restarts->empty());
}

TEST(GroupOptions, BadGramFieldsAreRefused) {
  ExpectMuonRefused(
      [](auto* h) { h->mutable_gram_restarts()->add_iterations(5); },
      "gram_restarts", "5");
  ExpectMuonRefused(
      [](auto* h) { h->mutable_gram_restarts()->add_iterations(0); },
      "gram_restarts", "0");
  ExpectMuonRefused([](auto* h) { h->set_gram_min_aspect_ratio(0.5); },
                    "gram_min_aspect_ratio", "0.5");
  v1::ParamGroup g = MuonGroup();
  g.mutable_muon()->mutable_gram_restarts()->add_iterations(3);
  g.mutable_muon()->mutable_gram_restarts()->add_iterations(2);
  EXPECT_THAT(MuonOptionsFromProto(g).status().message(),
              HasSubstr("group 'g': ns gram_restarts must be ascending"));
  g = MuonGroup();
  g.mutable_muon()->set_ns_algorithm(v1::NsAlgorithm(7));
  EXPECT_THAT(MuonOptionsFromProto(g).status().message(),
              HasSubstr("group 'g': ns_algorithm: value 7 is not one of"));
  g = MuonGroup();
  g.mutable_muon()->set_gram_dtype(v1::NsIterDType(9));
  EXPECT_THAT(MuonOptionsFromProto(g).status().message(),
              HasSubstr("group 'g': gram_dtype: value 9 is not one of"));
}

// A value finite as sent but not as a float32: 1e300 is inf as a float32;
// named as out of the fp32 range with the value as sent, not "non-finite".
TEST(GroupOptions, CustomCoefficientOutsideFloat32IsNamed) {
  v1::ParamGroup g = MuonGroup();
  g.mutable_muon()->set_coefficient_type(v1::COEFFICIENT_TYPE_CUSTOM);
  for (double v : {1.0, 1e300, 0.0})
    g.mutable_muon()->add_custom_coefficients(v);
  g.mutable_muon()->set_num_ns_steps(1);
  const absl::Status st = MuonOptionsFromProto(g).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(),
              HasSubstr("group 'g': custom_coefficients: tuple 0 value 1 must "
                        "be finite as a float32"));
  EXPECT_THAT(st.message(), HasSubstr("got 1e+300"));
}

// A custom coefficient above fp16's 65504 where Gram NS iterates in fp16
// (gram, medium, gram_dtype fp16 by default) is refused at registration; with
// gram_dtype bf16 it is accepted.
TEST(GroupOptions, CustomCoefficientAboveFp16RefusedForFp16Gram) {
  v1::ParamGroup g = MuonGroup();
  v1::MuonHyperparams* h = g.mutable_muon();
  h->set_coefficient_type(v1::COEFFICIENT_TYPE_CUSTOM);
  for (double v : {70000.0, 0.0, 0.0}) h->add_custom_coefficients(v);
  h->set_num_ns_steps(1);
  h->set_ns_algorithm(v1::NS_ALGORITHM_GRAM);
  h->set_fp32_matmul_prec(v1::MATMUL_PRECISION_MEDIUM);
  const absl::Status st = MuonOptionsFromProto(g).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(st.message(),
              HasSubstr("group 'g': custom coefficients: tuple 0"));
  EXPECT_THAT(st.message(), HasSubstr("fp16 range"));
  h->set_gram_dtype(v1::NS_ITER_DTYPE_BF16);
  EXPECT_TRUE(MuonOptionsFromProto(g).ok()) << MuonOptionsFromProto(g).status();
}

TEST(GroupOptions, MuonVariantsAndTheirOptionsFromTheWire) {
  absl::StatusOr<MuonOptions> d = MuonOptionsFromProto(MuonGroup());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->variant, MuonVariant::kMuon);
  EXPECT_EQ(d->beta2, 0.95);
  EXPECT_EQ(d->moment2_eps, 1e-8);
  v1::ParamGroup g = MuonGroup();
  g.mutable_muon()->set_variant(v1::MUON_VARIANT_NORMUON);
  g.mutable_muon()->set_beta2(0.9);
  g.mutable_muon()->set_moment2_eps(1e-6);
  absl::StatusOr<MuonOptions> o = MuonOptionsFromProto(g);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->variant, MuonVariant::kNorMuon);
  EXPECT_EQ(o->beta2, 0.9);
  EXPECT_EQ(o->moment2_eps, 1e-6);
  g.mutable_muon()->set_variant(v1::MUON_VARIANT_ADAMUON);
  EXPECT_EQ(MuonOptionsFromProto(g)->variant, MuonVariant::kAdaMuon);
}

TEST(GroupOptions, BadVariantBeta2OrMoment2EpsAreRefusedNamingTheRule) {
  ExpectMuonRefused([](v1::MuonHyperparams* h) { h->set_beta2(1.0); },
                    "muon beta2 must be in [0, 1)", "1");
  ExpectMuonRefused([](v1::MuonHyperparams* h) { h->set_beta2(-0.5); },
                    "muon beta2 must be in [0, 1)", "-0.5");
  ExpectMuonRefused([](v1::MuonHyperparams* h) { h->set_moment2_eps(0.0); },
                    "muon moment2_eps must be > 0 and finite as a float32",
                    "0");
  ExpectMuonRefused([](v1::MuonHyperparams* h) { h->set_moment2_eps(1e-300); },
                    "muon moment2_eps", "1e-300");
  v1::ParamGroup g = MuonGroup();
  g.mutable_muon()->set_variant(static_cast<v1::MuonVariant>(42));
  absl::StatusOr<MuonOptions> o = MuonOptionsFromProto(g);
  ASSERT_FALSE(o.ok());
  EXPECT_THAT(o.status().message(), HasSubstr("group 'g'"));
  EXPECT_THAT(o.status().message(),
              HasSubstr("variant: value 42 is not one of MUON_VARIANT_MUON, "
                        "MUON_VARIANT_NORMUON, MUON_VARIANT_ADAMUON"));
}

// A group with one param of each wire dtype in `dtypes`.
v1::ParamGroup WithParams(v1::ParamGroup g,
                          std::initializer_list<v1::DType> dtypes) {
  for (v1::DType d : dtypes) {
    g.add_params()->mutable_param()->set_dtype(d);
  }
  return g;
}

// Unspecified is auto, torch's rule (torch.optim's zeros_like state): bf16
// for a group whose params are all bf16, else fp32; for AdamW too.
TEST(GroupOptions, AutoStateDTypeFollowsTheParams) {
  struct Case {
    std::initializer_list<v1::DType> params;
    DType want;
  };
  const Case cases[] = {
      {{v1::DTYPE_BF16, v1::DTYPE_BF16}, DType::kBFloat16},
      {{v1::DTYPE_FP32}, DType::kFloat32},
      {{v1::DTYPE_BF16, v1::DTYPE_FP32}, DType::kFloat32},
      {{v1::DTYPE_FP16}, DType::kFloat32},
      {{}, DType::kFloat32},
  };
  for (const Case& c : cases) {
    absl::StatusOr<MuonOptions> m =
        MuonOptionsFromProto(WithParams(MuonGroup(), c.params));
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->state_dtype, c.want) << c.params.size();
    EXPECT_EQ(m->state_location, StateLocation::kDevice);
    absl::StatusOr<AdamWOptions> a =
        AdamWOptionsFromProto(WithParams(AdamWGroup(), c.params));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->state_dtype, c.want) << c.params.size();
  }
  // The daemon's bound params (the registered proto's are cleared).
  const DType bf16[] = {DType::kBFloat16};
  EXPECT_EQ(MuonOptionsFromProto(MuonGroup(), bf16)->state_dtype,
            DType::kBFloat16);
  EXPECT_EQ(AdamWOptionsFromProto(AdamWGroup(), bf16)->state_dtype,
            DType::kBFloat16);
}

// An explicit dtype or location wins over the params' dtypes.
TEST(GroupOptions, ExplicitStateDTypeAndLocationAreTaken) {
  const struct {
    v1::StateDType wire;
    DType core;
  } dtypes[] = {{v1::STATE_DTYPE_FP32, DType::kFloat32},
                {v1::STATE_DTYPE_BF16, DType::kBFloat16},
                {v1::STATE_DTYPE_FP8_E4M3, DType::kFloat8E4M3}};
  for (const auto& d : dtypes) {
    v1::ParamGroup m = WithParams(MuonGroup(), {v1::DTYPE_BF16});
    m.mutable_muon()->set_state_dtype(d.wire);
    m.mutable_muon()->set_state_location(v1::STATE_LOCATION_HOST);
    absl::StatusOr<MuonOptions> mo = MuonOptionsFromProto(m);
    ASSERT_TRUE(mo.ok()) << mo.status();
    EXPECT_EQ(mo->state_dtype, d.core);
    EXPECT_EQ(mo->state_location, StateLocation::kHost);
    v1::ParamGroup a = WithParams(AdamWGroup(), {v1::DTYPE_FP32});
    a.mutable_adamw()->set_state_dtype(d.wire);
    a.mutable_adamw()->set_state_location(v1::STATE_LOCATION_DEVICE);
    absl::StatusOr<AdamWOptions> ao = AdamWOptionsFromProto(a);
    ASSERT_TRUE(ao.ok()) << ao.status();
    EXPECT_EQ(ao->state_dtype, d.core);
    EXPECT_EQ(ao->state_location, StateLocation::kDevice);
    EXPECT_EQ(StateDTypeToProto(d.core), d.wire);
  }
  EXPECT_EQ(ToProto(StateLocation::kHost), v1::STATE_LOCATION_HOST);
  EXPECT_EQ(ToProto(StateLocation::kDevice), v1::STATE_LOCATION_DEVICE);
}

TEST(GroupOptions, UnknownStateEnumsAreRefusedNamingGroupAndField) {
  v1::ParamGroup m = MuonGroup();
  m.mutable_muon()->set_state_dtype(static_cast<v1::StateDType>(9));
  absl::Status st = MuonOptionsFromProto(m).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(),
              HasSubstr("group 'g': state_dtype: value 9 is not one of "
                        "STATE_DTYPE_FP32, STATE_DTYPE_BF16, "
                        "STATE_DTYPE_FP8_E4M3"));
  // 3, DType's FP16 (reserved here), is no state dtype either.
  m.mutable_muon()->set_state_dtype(static_cast<v1::StateDType>(3));
  st = MuonOptionsFromProto(m).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("state_dtype: value 3 is not one of"));
  v1::ParamGroup a = AdamWGroup();
  a.mutable_adamw()->set_state_location(static_cast<v1::StateLocation>(5));
  st = AdamWOptionsFromProto(a).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(),
              HasSubstr("group 'a': state_location: value 5 is not one of "
                        "STATE_LOCATION_DEVICE, STATE_LOCATION_HOST"));
}

// A host-mode daemon (no GPU) takes host state: the same host memory.
TEST(GroupOptions, HostStateIsAcceptedWithoutAGpu) {
  v1::ParamGroup m = MuonGroup();
  m.mutable_muon()->set_state_location(v1::STATE_LOCATION_HOST);
  EXPECT_TRUE(ValidateGroupForDevice(m, /*device=*/-1).ok());
  v1::ParamGroup a = AdamWGroup();
  a.mutable_adamw()->set_state_location(v1::STATE_LOCATION_HOST);
  EXPECT_TRUE(ValidateGroupForDevice(a, /*device=*/-1).ok());
}

}  // namespace
}  // namespace muond
