// Classification for every tag combination x {G, T} in {1,2,4}^2, against an
// independent restatement of docs/ARCHITECTURE.md "Sharding", plus every error
// case.
#include "core/plan/sharding.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

struct Expected {
  bool ok;
  int tp_dim;
  bool gtp;
  ParamSharding sharding;
  std::vector<int64_t> full;
};

// docs/ARCHITECTURE.md "Sharding", written out case by case.
Expected Reference(const ShardTags& tags, int64_t r, int64_t c, int G, int T) {
  const bool tp_counts =
      T > 1 && tags.tensor_model_parallel && tags.partition_dim >= 0;
  const int tp_dim = tp_counts ? tags.partition_dim : -1;
  const bool gtp = G > 1 && tags.is_gtp_weight_remat;
  const Expected error{false, -1, false, ParamSharding::kReplicated, {}};
  if (tp_dim >= 0 && !gtp && G > 1) return error;
  if (tags.pad_length > 0 && !gtp) return error;
  if (gtp && tags.pad_length >= r * G) return error;
  ParamSharding sharding = ParamSharding::kReplicated;
  if (tp_dim >= 0 && gtp) sharding = ParamSharding::kGtpRematAndTp;
  if (tp_dim >= 0 && !gtp) sharding = ParamSharding::kTp;
  if (tp_dim < 0 && gtp) sharding = ParamSharding::kGtpRemat;
  int64_t rows = gtp ? r * G - tags.pad_length : r;
  int64_t cols = c;
  if (tp_dim == 0) rows *= T;
  if (tp_dim == 1) cols *= T;
  return {true, tp_dim, gtp, sharding, {rows, cols}};
}

TEST(MakeShardSpec, EveryTagCombinationEveryDomain) {
  const int64_t r = 3, c = 5;
  int checked = 0, errors = 0;
  for (int G : {1, 2, 4})
    for (int T : {1, 2, 4})
      for (bool tmp : {false, true})
        for (int pd : {-1, 0, 1})
          for (bool gtp_tag : {false, true})
            for (int64_t pad : {0, 1, 3}) {
              ShardTags tags{tmp, pd, gtp_tag, pad};
              const Expected want = Reference(tags, r, c, G, T);
              const std::string name = "layers.7.w";
              absl::StatusOr<ParamShardSpec> got =
                  MakeShardSpec(name, {r, c}, tags, DomainSize{G, T});
              SCOPED_TRACE(testing::Message()
                           << "G=" << G << " T=" << T << " tmp=" << tmp
                           << " pd=" << pd << " gtp=" << gtp_tag
                           << " pad=" << pad);
              ++checked;
              ASSERT_EQ(got.ok(), want.ok) << got.status();
              if (!want.ok) {
                ++errors;
                EXPECT_EQ(got.status().code(),
                          absl::StatusCode::kInvalidArgument);
                EXPECT_THAT(std::string(got.status().message()),
                            HasSubstr(name));
                continue;
              }
              EXPECT_EQ(got->name, name);
              EXPECT_EQ(got->tp_dim, want.tp_dim);
              EXPECT_EQ(got->gtp_sharded, want.gtp);
              EXPECT_EQ(got->sharding, want.sharding);
              EXPECT_EQ(got->full_shape, want.full);
              EXPECT_EQ(got->local_shape, (std::vector<int64_t>{r, c}));
              EXPECT_EQ(got->pad_length, pad);
              EXPECT_TRUE(ValidateShardSpec(*got, DomainSize{G, T}).ok());
              // The full-shape factory reproduces the same spec.
              absl::StatusOr<ParamShardSpec> again =
                  MakeShardSpecFromFullShape(name, want.full, want.tp_dim,
                                             want.gtp, pad, DomainSize{G, T});
              ASSERT_TRUE(again.ok()) << again.status();
              EXPECT_EQ(again->local_shape, got->local_shape);
              EXPECT_EQ(again->sharding, got->sharding);
            }
  EXPECT_EQ(checked, 3 * 3 * 2 * 3 * 2 * 3);
  EXPECT_GT(errors, 0);
}

TEST(MakeShardSpec, TpShardedWithoutGtpInGtpDomainIsAnError) {
  absl::StatusOr<ParamShardSpec> s = MakeShardSpec(
      "dec.0.fc1", {8, 8}, ShardTags{true, 0, false, 0}, DomainSize{2, 2});
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("dec.0.fc1"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("corrupt"));
  // The same param is fine when the GTP axis is absent...
  EXPECT_TRUE(MakeShardSpec("dec.0.fc1", {8, 8}, ShardTags{true, 0, false, 0},
                            DomainSize{1, 2})
                  .ok());
  // ...or when its TP tag does not count (partition_dim without the flag).
  absl::StatusOr<ParamShardSpec> dup = MakeShardSpec(
      "dup", {8, 8}, ShardTags{false, 0, false, 0}, DomainSize{2, 2});
  ASSERT_TRUE(dup.ok());
  EXPECT_EQ(dup->sharding, ParamSharding::kReplicated);
}

TEST(MakeShardSpec, ShapeAndTagErrorsNameTheParam) {
  const DomainSize d{2, 2};
  struct Bad {
    std::vector<int64_t> shape;
    ShardTags tags;
    const char* rule;
  };
  const std::vector<Bad> bad = {
      {{8}, {}, "not 2-D"},
      {{2, 3, 4}, {}, "not 2-D"},
      {{-1, 4}, {}, "<= 0"},
      {{4, 0}, {}, "<= 0"},
      {{4, 4}, ShardTags{true, 2, true, 0}, "partition_dim"},
      {{4, 4}, ShardTags{true, -2, true, 0}, "partition_dim"},
      {{4, 4}, ShardTags{false, -1, true, -1}, "< 0"},
      {{4, 4}, ShardTags{false, -1, false, 1}, "not GTP-sharded"},
      {{4, 4}, ShardTags{false, -1, true, 8}, "gathered dim"},
      {{4, 4}, ShardTags{false, -1, true, 9}, "gathered dim"},
  };
  for (const Bad& b : bad) {
    absl::StatusOr<ParamShardSpec> s =
        MakeShardSpec("model.bad_param", b.shape, b.tags, d);
    ASSERT_FALSE(s.ok()) << b.rule;
    EXPECT_THAT(std::string(s.status().message()),
                HasSubstr("model.bad_param"));
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(b.rule));
  }
  absl::StatusOr<ParamShardSpec> s =
      MakeShardSpec("p", {4, 4}, ShardTags{}, DomainSize{0, 2});
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("'p'"));
}

TEST(MakeShardSpecFromFullShape, AutoPadAndDivisibilityErrors) {
  // 14336 rows column-parallel over T=2 -> 7168 TP-local; G=3 -> pad 2.
  absl::StatusOr<ParamShardSpec> s = MakeShardSpecFromFullShape(
      "gate", {14336, 4096}, 0, true, -1, DomainSize{3, 2});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->pad_length, 2);
  EXPECT_EQ(s->local_shape, (std::vector<int64_t>{2390, 4096}));
  EXPECT_EQ(TpLocalShape(*s, DomainSize{3, 2}),
            (std::vector<int64_t>{7168, 4096}));
  EXPECT_EQ(ValidLocalRows(*s, DomainSize{3, 2}, 2), 2388);
  EXPECT_EQ(ValidLocalRows(*s, DomainSize{3, 2}, 0), 2390);

  s = MakeShardSpecFromFullShape("odd", {15, 4}, 0, true, 0, DomainSize{1, 2});
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("'odd'"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("divisible by T"));
  s = MakeShardSpecFromFullShape("odd", {10, 4}, -1, true, 1, DomainSize{4, 1});
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("divisible by G"));
  s = MakeShardSpecFromFullShape("x", {8, 4}, 3, true, 0, DomainSize{2, 2});
  EXPECT_FALSE(s.ok());
  // Axes of size 1 drop their tags.
  s = MakeShardSpecFromFullShape("x", {8, 4}, 1, true, -1, DomainSize{1, 1});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->sharding, ParamSharding::kReplicated);
  EXPECT_EQ(s->local_shape, (std::vector<int64_t>{8, 4}));
}

TEST(ValidateShardSpec, RejectsInconsistentSpecs) {
  const DomainSize d{2, 2};
  absl::StatusOr<ParamShardSpec> good =
      MakeShardSpec("w", {4, 6}, ShardTags{true, 1, true, 1}, d);
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good->full_shape, (std::vector<int64_t>{7, 12}));
  ASSERT_TRUE(ValidateShardSpec(*good, d).ok());
  auto expect_bad = [&](ParamShardSpec s, const char* rule) {
    absl::Status st = ValidateShardSpec(s, d);
    EXPECT_FALSE(st.ok()) << rule;
    EXPECT_THAT(std::string(st.message()), HasSubstr("'w'"));
    EXPECT_THAT(std::string(st.message()), HasSubstr(rule));
  };
  ParamShardSpec s = *good;
  s.full_shape = {8, 12};
  expect_bad(s, "inconsistent");
  s = *good;
  s.sharding = ParamSharding::kTp;
  expect_bad(s, "does not match");
  s = *good;
  s.gtp_sharded = false;
  expect_bad(s, "not GTP-sharded");
  EXPECT_FALSE(ValidateShardSpec(*good, DomainSize{1, 2}).ok());
  EXPECT_FALSE(ValidateShardSpec(*good, DomainSize{2, 1}).ok());
}

// ---- Uneven GTP row blocks --------------------------------------------------
// Reference: block g of the padded TP-local rows starts at the sum of the
// blocks before it; its real rows are those below R.
int64_t RefStart(const std::vector<int64_t>& rows, int g) {
  int64_t start = 0;
  for (int q = 0; q < g; ++q) start += rows[q];
  return start;
}

TEST(UnevenGtpRows, TorchChunkShardsEveryRankColAndRowParallel) {
  struct Uneven {
    int G, T, tp_dim;
    int64_t full_rows, cols, pad;
    std::vector<int64_t> gtp_rows;
  };
  const std::vector<Uneven> cases = {
      {2, 1, -1, 38, 24, 0, {19, 19}},
      {2, 1, -1, 37, 24, 0, {19, 18}},
      {4, 1, -1, 3, 8, 0, {1, 1, 1, 0}},
      {2, 2, 0, 74, 6, 0, {19, 18}},      // column-parallel: 37 TP-local rows
      {2, 2, 1, 37, 12, 0, {19, 18}},     // row-parallel: 6 TP-local cols
      {4, 2, 0, 6, 4, 1, {1, 1, 1, 1}},   // 3 TP-local + 1 pad, even blocks
      {4, 1, -1, 5, 4, 3, {3, 3, 2, 0}},  // Megatron pad + uneven
  };
  for (const Uneven& u : cases) {
    const DomainSize d{u.G, u.T};
    const int64_t tp_rows = u.tp_dim == 0 ? u.full_rows / u.T : u.full_rows;
    const int64_t tp_cols = u.tp_dim == 1 ? u.cols / u.T : u.cols;
    for (int g = 0; g < u.G; ++g) {
      SCOPED_TRACE(testing::Message() << "rows " << u.full_rows << " G=" << u.G
                                      << " T=" << u.T << " g=" << g);
      ShardTags tags{u.tp_dim >= 0, u.tp_dim, true, u.pad, u.gtp_rows};
      absl::StatusOr<ParamShardSpec> spec =
          MakeShardSpec("ffn.w", {u.gtp_rows[g], tp_cols}, tags, d, g);
      ASSERT_TRUE(spec.ok()) << spec.status();
      EXPECT_EQ(spec->full_shape, (std::vector<int64_t>{u.full_rows, u.cols}));
      EXPECT_EQ(spec->gtp_rows, u.gtp_rows);
      EXPECT_EQ(TpLocalShape(*spec, d),
                (std::vector<int64_t>{tp_rows, tp_cols}));
      EXPECT_TRUE(ValidateShardSpec(*spec, d, g).ok());
      EXPECT_TRUE(ValidateShardSpec(*spec, d).ok());
      for (int q = 0; q < u.G; ++q) {
        const int64_t start = RefStart(u.gtp_rows, q);
        EXPECT_EQ(GtpRowBlockOf(*spec, d, q).start, start);
        EXPECT_EQ(GtpRowBlockOf(*spec, d, q).rows, u.gtp_rows[q]);
        EXPECT_EQ(
            ValidLocalRows(*spec, d, q),
            std::max<int64_t>(0, std::min(u.gtp_rows[q], tp_rows - start)));
      }
      // From the full shape: the same spec for rank g (pad given or derived).
      for (int64_t pad : {u.pad, int64_t{-1}}) {
        absl::StatusOr<ParamShardSpec> again =
            MakeShardSpecFromFullShape("ffn.w", {u.full_rows, u.cols}, u.tp_dim,
                                       true, pad, d, u.gtp_rows, g);
        ASSERT_TRUE(again.ok()) << again.status();
        EXPECT_EQ(again->local_shape, spec->local_shape);
        EXPECT_EQ(again->pad_length, u.pad);
        EXPECT_EQ(again->gtp_rows, u.gtp_rows);
      }
    }
  }
}

TEST(UnevenGtpRows, BadBlocksAreRefusedNamingParamAndRule) {
  const DomainSize d{2, 1};
  struct Bad {
    std::vector<int64_t> local;
    ShardTags tags;
    int g;
    const char* rule;
  };
  const std::vector<Bad> bad = {
      {{19, 4}, ShardTags{false, -1, true, 0, {19}}, 0, "needs one per GTP"},
      {{19, 4},
       ShardTags{false, -1, true, 0, {19, 18, 0}},
       0,
       "needs one per GTP"},
      {{19, 4}, ShardTags{false, -1, true, 0, {19, -1}}, 0, "gtp_rows[1] = -1"},
      {{19, 4}, ShardTags{false, -1, false, 0, {19, 18}}, 0, "not GTP-sharded"},
      {{18, 4},
       ShardTags{false, -1, true, 0, {19, 18}},
       0,
       "!= gtp_rows[0] = 19"},
      {{19, 4},
       ShardTags{false, -1, true, 0, {19, 18}},
       1,
       "!= gtp_rows[1] = 18"},
      {{0, 4}, ShardTags{false, -1, true, 0, {}}, 0, "<= 0"},
      {{0, 4}, ShardTags{false, -1, true, 1, {1, 0}}, 1, "no real rows"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.rule);
    absl::StatusOr<ParamShardSpec> s =
        MakeShardSpec("model.bad_rows", b.local, b.tags, d, b.g);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.status().message()), HasSubstr("model.bad_rows"));
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(b.rule));
  }
  // Without a GTP axis the tag counts for nothing but gtp_rows is refused.
  absl::StatusOr<ParamShardSpec> s = MakeShardSpec(
      "w1", {4, 4}, ShardTags{false, -1, true, 0, {4}}, DomainSize{1, 2});
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("not GTP-sharded"));
  // The sum against the full shape.
  s = MakeShardSpecFromFullShape("w2", {37, 4}, -1, true, 0, d, {19, 19}, 0);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("'w2'"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("sum to 38"));
  s = MakeShardSpecFromFullShape("w3", {37, 4}, -1, true, -1, d, {18, 18}, 0);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("fewer than"));
  // 1-D shards (AdamW) use the same rule.
  EXPECT_EQ(*GtpLocalRows("b", 37, 0, {19, 18}, d, 1), 18);
  EXPECT_EQ(*GtpLocalRows("b", 36, 0, {}, d, 1), 18);
  EXPECT_FALSE(GtpLocalRows("b", 37, 0, {}, d, 1).ok());
  absl::StatusOr<int64_t> rows = GtpLocalRows("b", 37, 0, {20, 18}, d, 1);
  ASSERT_FALSE(rows.ok());
  EXPECT_THAT(std::string(rows.status().message()), HasSubstr("'b'"));
  // A spec received from elsewhere whose local rows are no rank's block.
  absl::StatusOr<ParamShardSpec> good = MakeShardSpec(
      "w4", {19, 4}, ShardTags{false, -1, true, 0, {19, 18}}, d, 0);
  ASSERT_TRUE(good.ok());
  ParamShardSpec wrong = *good;
  wrong.local_shape = {17, 4};
  EXPECT_THAT(std::string(ValidateShardSpec(wrong, d).message()),
              HasSubstr("no rank's block"));
  EXPECT_THAT(std::string(ValidateShardSpec(*good, d, 1).message()),
              HasSubstr("!= gtp_rows[1]"));
}

TEST(Cost, NsCostAndFlopsKnownValues) {
  EXPECT_EQ(NsCost(4096, 14336), 14336.0 * 4096 * 4096);
  EXPECT_EQ(NsCost(14336, 4096), NsCost(4096, 14336));
  EXPECT_EQ(NsCostOfShape({3, 4, 5}), 60.0);
  EXPECT_EQ(NsCostOfShape({7}), 7.0);
  // NsFlops' count (sharding.h): 4096x14336, plain NS, 5 steps = 5.50 TFLOP.
  const double m = 4096, n = 14336;
  EXPECT_EQ(NsFlops(4096, 14336, 5, false),
            5 * (4 * m * m * n + 2 * m * m * m));
  EXPECT_NEAR(NsFlops(4096, 14336, 5, false) / 1e12, 5.50, 0.005);
  // Square: (20 alpha + 10) m^3 = 30 m^3; symmetric 5 (3 alpha + 1) m^3 = 20
  // m^3.
  EXPECT_EQ(NsFlops(1024, 1024, 5, false), 30.0 * 1024 * 1024 * 1024);
  EXPECT_EQ(NsFlops(1024, 1024, 5, true), 20.0 * 1024 * 1024 * 1024);
  EXPECT_EQ(NsFlops(1024, 1024, 3, false), 18.0 * 1024 * 1024 * 1024);
}

// 1-D tensors: whole, an equal TP piece, then a GTP block, against hand
// values.
TEST(LocalLengthOf1d, WholeOrSplitByTpThenGtp) {
  ShardTags none;
  EXPECT_EQ(*LocalLengthOf1d("b", 12, none, DomainSize{2, 2}, 1), 12);
  ShardTags tp;
  tp.tensor_model_parallel = true;
  tp.partition_dim = 0;
  EXPECT_EQ(*LocalLengthOf1d("b", 12, tp, DomainSize{1, 4}, 0), 3);
  // partition_dim 1 (or -1) on a 1-D tensor: every TP rank holds it whole.
  ShardTags tp_dim1 = tp;
  tp_dim1.partition_dim = 1;
  EXPECT_EQ(*LocalLengthOf1d("b", 12, tp_dim1, DomainSize{1, 4}, 0), 12);
  // An axis of size 1 ignores its tag.
  EXPECT_EQ(*LocalLengthOf1d("b", 12, tp, DomainSize{1, 1}, 0), 12);
  ShardTags gtp;
  gtp.is_gtp_weight_remat = true;
  gtp.pad_length = 2;
  // (12 + 2) / 2 = 7 per GTP rank.
  EXPECT_EQ(*LocalLengthOf1d("b", 12, gtp, DomainSize{2, 1}, 1), 7);
  ShardTags both = gtp;
  both.tensor_model_parallel = true;
  both.partition_dim = 0;
  // TP first: 12 / 2 = 6, then (6 + 2) / 2 = 4.
  EXPECT_EQ(*LocalLengthOf1d("b", 12, both, DomainSize{2, 2}, 0), 4);
  ShardTags uneven = both;
  uneven.pad_length = 0;
  uneven.gtp_rows = {5, 1};
  EXPECT_EQ(*LocalLengthOf1d("b", 12, uneven, DomainSize{2, 2}, 1), 1);
}

TEST(LocalLengthOf1d, ErrorsNameTheParamAndTheRule) {
  ShardTags tp;
  tp.tensor_model_parallel = true;
  tp.partition_dim = 0;
  EXPECT_EQ(
      LocalLengthOf1d("b", 10, tp, DomainSize{1, 4}, 0).status().message(),
      "param 'b': full_shape [10] not divisible by tp_size 4");
  ShardTags gtp;
  gtp.is_gtp_weight_remat = true;
  EXPECT_THAT(
      std::string(
          LocalLengthOf1d("b", 5, gtp, DomainSize{2, 1}, 0).status().message()),
      HasSubstr("param 'b': TP-local dim 0 (5) + pad_length (0) is not "
                "divisible by G=2"));
  // gtp_rows on a tensor that is not GTP-split.
  ShardTags rows_only;
  rows_only.gtp_rows = {6, 6};
  const absl::Status st =
      LocalLengthOf1d("b", 12, rows_only, DomainSize{2, 1}, 0).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("param 'b': gtp_rows"));
}

TEST(ParamShardingName, AllNames) {
  EXPECT_STREQ(ParamShardingName(ParamSharding::kReplicated), "REPLICATED");
  EXPECT_STREQ(ParamShardingName(ParamSharding::kGtpRemat), "GTP_REMAT");
  EXPECT_STREQ(ParamShardingName(ParamSharding::kTp), "TP");
  EXPECT_STREQ(ParamShardingName(ParamSharding::kGtpRematAndTp),
               "GTP_REMAT_AND_TP");
}

}  // namespace
}  // namespace muond
