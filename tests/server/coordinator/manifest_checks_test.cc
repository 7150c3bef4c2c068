// CoordinatorCore in-process. The rules of a published manifest: its own fields
// (names, domains, shapes, resume fields) and its agreement with the other
// ranks of its domain (params, hyperparameters, replicas); messages name the
// param and both ranks. Plans come from the real core planner (PlanGroup).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "server/common/job_id.h"
#include "server/common/proto_convert.h"
#include "server/coordinator/coordinator_core.h"
#include "server/coordinator/coordinator_metrics.h"
#include "tests/server/coordinator/coordinator_fixtures.h"

namespace muond {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ManifestChecks, ManifestMismatchNamesParamAndRanks) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  ASSERT_TRUE(core.PublishManifest(Manifest("j", 0, kShapes)).ok());
  std::vector<std::pair<int64_t, int64_t>> other = kShapes;
  other[2] = {64, 128};
  absl::Status st = core.PublishManifest(Manifest("j", 1, other));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("'w2'"));
  EXPECT_THAT(st.message(), HasSubstr("rank 0"));
  EXPECT_THAT(st.message(), HasSubstr("rank 1"));
  EXPECT_THAT(st.message(), HasSubstr("full_shape"));
  // A missing param is named too.
  // Each refusal refuses the round (rank 0's manifest goes): publish it again.
  ASSERT_TRUE(core.PublishManifest(Manifest("j", 0, kShapes)).ok());
  std::vector<std::pair<int64_t, int64_t>> shorter(kShapes.begin(),
                                                   kShapes.end() - 1);
  st = core.PublishManifest(Manifest("j", 2, shorter));
  EXPECT_THAT(st.message(), HasSubstr("'w5'"));
  // Two ranks claiming the same coordinates.
  v1::PublishManifestRequest clash = Manifest("j", 3, kShapes);
  clash.mutable_groups(0)->mutable_domain()->set_g(0);
  clash.mutable_groups(0)->mutable_domain()->set_t(0);
  ASSERT_TRUE(core.PublishManifest(Manifest("j", 0, kShapes)).ok());
  st = core.PublishManifest(clash);
  EXPECT_THAT(st.message(), HasSubstr("both claim (g=0, t=0)"));
  // Nothing was stored, and each refusal refused the round (rank 0's
  // manifest went with it): every rank publishing again completes the job.
  EXPECT_EQ(core.GetPlan("j").status().code(), absl::StatusCode::kNotFound);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishManifest(Manifest("j", r, kShapes)).ok());
  }
  EXPECT_TRUE(core.GetPlan("j").ok());
}

// Uneven GTP blocks (FSDP2's torch.chunk): local shapes differ by g and may
// have no row; the blocks are compared like the other tags.
v1::PublishManifestRequest UnevenManifest(int rank, bool swap_blocks = false) {
  v1::PublishManifestRequest m = Manifest("j", rank, {{74, 8}, {4, 8}});
  const int g = rank / 2;
  // w0: 37 TP-local rows in blocks {19, 18}; w1: 2 in {2, 0}.
  const std::vector<std::vector<int64_t>> blocks = {
      swap_blocks ? std::vector<int64_t>{18, 19} : std::vector<int64_t>{19, 18},
      {2, 0}};
  for (int i = 0; i < 2; ++i) {
    v1::ParamSpec* p = m.mutable_groups(0)->mutable_params(i);
    for (int64_t rows : blocks[i]) p->mutable_tags()->add_gtp_rows(rows);
    p->set_local_shape(0, blocks[i][g]);
  }
  return m;
}

TEST(ManifestChecks, UnevenAndEmptyGtpBlocksArePlannedAndCompared) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(core.PublishManifest(UnevenManifest(r)).ok()) << r;
  }
  ASSERT_TRUE(core.GetPlan("j").ok());
  EXPECT_EQ(core.GetPlan("j")->groups(0).homes_size(), 2);
  CoordinatorCore other(Options());
  JoinAll(other, "j", 4);
  ASSERT_TRUE(other.PublishManifest(UnevenManifest(0)).ok());
  const absl::Status st = other.PublishManifest(UnevenManifest(2, true));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("'w0'"));
  EXPECT_THAT(st.message(), HasSubstr("gtp_rows=[19, 18]"));
  EXPECT_THAT(st.message(), HasSubstr("gtp_rows=[18, 19]"));
}

TEST(ManifestChecks, DuplicateParamNamesRefused) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  v1::PublishManifestRequest m = Manifest("j", 0, kShapes);
  m.mutable_groups(0)->mutable_params(3)->set_name("w1");
  absl::Status st = core.PublishManifest(m);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("duplicate param name 'w1'"));
}

TEST(ManifestChecks, HyperparamsMustAgreeAcrossRanks) {
  struct Case {
    const char* field;
    std::function<void(v1::MuonHyperparams&)> edit;
    const char* rank0_value;
    const char* rank1_value;
  };
  const std::vector<Case> cases = {
      {"fp32_matmul_prec",
       [](v1::MuonHyperparams& h) {
         h.set_fp32_matmul_prec(v1::MATMUL_PRECISION_HIGH);
       },
       "MATMUL_PRECISION_HIGHEST", "MATMUL_PRECISION_HIGH"},
      {"lr", [](v1::MuonHyperparams& h) { h.set_lr(0.5); }, "0.02", "0.5"},
      {"num_ns_steps", [](v1::MuonHyperparams& h) { h.set_num_ns_steps(3); },
       "unset", "3"},
      {"momentum", [](v1::MuonHyperparams& h) { h.set_momentum(0.9); }, "0.95",
       "0.9"},
      {"custom_coefficients",
       [](v1::MuonHyperparams& h) { h.add_custom_coefficients(1.5); }, "[]",
       "[1.5]"},
      // A message field printed on one line (not TextFormat's lines), set but
      // empty as {} (a set empty list is "no restart", unset the default).
      {"gram_restarts",
       [](v1::MuonHyperparams& h) {
         h.mutable_gram_restarts()->add_iterations(1);
       },
       "unset", "{iterations: [1]};"},
      {"gram_restarts",
       [](v1::MuonHyperparams& h) { h.mutable_gram_restarts(); }, "unset",
       "{};"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    CoordinatorCore core(Options());
    JoinAll(core, "j", 4);
    v1::PublishManifestRequest m0 = Manifest("j", 0, kShapes);
    v1::MuonHyperparams* h0 = m0.mutable_groups(0)->mutable_muon();
    h0->set_lr(0.02);
    h0->set_momentum(0.95);
    h0->set_fp32_matmul_prec(v1::MATMUL_PRECISION_HIGHEST);
    ASSERT_TRUE(core.PublishManifest(m0).ok());
    v1::PublishManifestRequest m1 = Manifest("j", 1, kShapes);
    *m1.mutable_groups(0)->mutable_muon() = *h0;
    c.edit(*m1.mutable_groups(0)->mutable_muon());
    absl::Status st = core.PublishManifest(m1);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(), HasSubstr("group 'muon'"));
    EXPECT_THAT(st.message(), HasSubstr(c.field));
    EXPECT_THAT(st.message(),
                HasSubstr(absl::StrCat("rank 0 has ", c.rank0_value)));
    EXPECT_THAT(st.message(),
                HasSubstr(absl::StrCat("rank 1 has ", c.rank1_value)));
    // The refused rank can publish agreeing hyperparameters.
    *m1.mutable_groups(0)->mutable_muon() = *h0;
    EXPECT_TRUE(core.PublishManifest(m1).ok());
  }
}

TEST(ManifestChecks, AdamWHyperparamsAndAlgorithmMustAgree) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  v1::PublishManifestRequest m0 = Manifest("j", 0, kShapes);
  m0.mutable_groups(0)->mutable_adamw()->set_beta2(0.99);
  ASSERT_TRUE(core.PublishManifest(m0).ok());
  v1::PublishManifestRequest m1 = Manifest("j", 1, kShapes);
  absl::Status st = core.PublishManifest(m1);
  EXPECT_THAT(st.message(), HasSubstr("AdamWHyperparams.beta2"));
  EXPECT_THAT(st.message(), HasSubstr("rank 1 has unset"));
  m1.mutable_groups(0)->set_algorithm(v1::ALGORITHM_ADAMW);
  *m1.mutable_groups(0)->mutable_adamw() = m0.groups(0).adamw();
  // The refusal refused the round (rank 0's manifest went with it).
  ASSERT_TRUE(core.PublishManifest(m0).ok());
  st = core.PublishManifest(m1);
  EXPECT_THAT(st.message(),
              HasSubstr("algorithm: ALGORITHM_MUON vs ALGORITHM_ADAMW"));
}

TEST(ManifestChecks, RawManifestIsValidatedFully) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  auto refused = [&core](const std::function<void(v1::GroupManifest&)>& edit,
                         const std::string& want) {
    v1::PublishManifestRequest m = Manifest("j", 0, kShapes);
    edit(*m.mutable_groups(0));
    absl::Status st = core.PublishManifest(m);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_THAT(st.message(), HasSubstr(want));
  };
  refused([](v1::GroupManifest& g) { g.set_algorithm(v1::Algorithm(99)); },
          "algorithm: value 99");
  refused(
      [](v1::GroupManifest& g) {
        g.mutable_domain()->set_gtp_size(1 << 20);
        g.mutable_domain()->set_tp_size(1 << 20);
      },
      "more than job 'j' world size 4");
  refused(
      [](v1::GroupManifest& g) { g.mutable_params(0)->set_local_shape(1, -3); },
      "local_shape [16, -3] has a dim < 1");
  refused(
      [](v1::GroupManifest& g) {
        g.mutable_params(0)->set_full_shape(0, int64_t(1) << 40);
        g.mutable_params(0)->set_full_shape(1, int64_t(1) << 40);
      },
      "more elements than int64 holds");
  refused([](v1::GroupManifest& g) { g.mutable_params(0)->add_full_shape(2); },
          "must have 1 or 2 dims");
  refused(
      [](v1::GroupManifest& g) { g.mutable_params(0)->clear_local_shape(); },
      "local_shape [] must have 1 or 2 dims");
  // Nothing was stored: the valid manifests still plan.
  PublishAll4(core, "j");
  EXPECT_TRUE(core.GetPlan("j").ok());
}

// A replica whose manifest differs from the others' at the same (g, t) is
// refused naming the group, the param, both ranks and the field.
TEST(ManifestChecks, ReplicaManifestsMustAgree) {
  struct Case {
    std::function<void(v1::ParamSpec&)> change;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](v1::ParamSpec& p) { p.set_full_shape(0, 128); },
       "full_shape [64, 32] vs [128, 32]"},
      {[](v1::ParamSpec& p) { p.set_local_shape(0, 16); },
       "local_shape [32, 32] vs [16, 32]"},
      {[](v1::ParamSpec& p) { p.mutable_tags()->add_gtp_rows(32); },
       "gtp_rows=[]} vs {tensor_model_parallel=1, partition_dim=0, "
       "is_gtp_weight_remat=0, pad_length=0, gtp_rows=[32]}"},
  };
  for (const Case& c : cases) {
    CoordinatorCore core(Options());
    JoinAll(core, "j", 4);
    ASSERT_TRUE(core.PublishManifest(DpManifest("j", 0, 2, 2, kShapes)).ok());
    ASSERT_TRUE(core.PublishManifest(DpManifest("j", 1, 2, 2, kShapes)).ok());
    v1::PublishManifestRequest bad = DpManifest("j", 2, 2, 2, kShapes);
    c.change(*bad.mutable_groups(0)->mutable_params(0));
    const absl::Status st = core.PublishManifest(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(st.message(),
                HasSubstr("group 'muon': rank 0 and rank 2 (replicas d=0 and "
                          "d=1 of (g=0, t=0)) differ at param #0 'w0'"));
    EXPECT_THAT(st.message(), HasSubstr(c.want));
  }
}

TEST(ManifestChecks, DpSizeAndReplicaAreChecked) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 4);
  ASSERT_TRUE(core.PublishManifest(DpManifest("j", 0, 2, 2, kShapes)).ok());
  v1::PublishManifestRequest other = DpManifest("j", 1, 2, 2, kShapes);
  other.mutable_groups(0)->mutable_domain()->set_dp_size(1);
  absl::Status st = core.PublishManifest(other);
  EXPECT_EQ(st.message(),
            "group 'muon': rank 1 has domain 'dense' 1x2 but rank 0 has "
            "'dense' 2x1x2");
  v1::PublishManifestRequest outside = DpManifest("j", 1, 2, 2, kShapes);
  outside.mutable_groups(0)->mutable_domain()->set_d(2);
  st = core.PublishManifest(outside);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("replica d=2 lies outside dp_size 2"));
  // More ranks than the job has.
  st = core.PublishManifest(DpManifest("j", 1, 4, 2, kShapes));
  EXPECT_THAT(st.message(), HasSubstr("4x1x2 has 8 ranks, more than job 'j' "
                                      "world size 4"));
}

}  // namespace
}  // namespace muond
