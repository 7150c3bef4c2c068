#include "core/comm/groups.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace muond {
namespace {

TEST(SplitDomain, EveryShapeUpToFourByFour) {
  for (int G = 1; G <= 4; ++G) {
    for (int T = 1; T <= 4; ++T) {
      // Reference: flat ranks numbered row-major over (g, t).
      std::vector<std::vector<int>> flat(G, std::vector<int>(T));
      int next = 0;
      for (int g = 0; g < G; ++g)
        for (int t = 0; t < T; ++t) flat[g][t] = next++;

      std::set<std::string> prefixes;
      for (int g = 0; g < G; ++g) {
        for (int t = 0; t < T; ++t) {
          SCOPED_TRACE(::testing::Message()
                       << G << "x" << T << " at (" << g << "," << t << ")");
          absl::StatusOr<DomainGroups> groups =
              SplitDomain(G, T, g, t, "j/d/v1");
          ASSERT_TRUE(groups.ok()) << groups.status();
          EXPECT_EQ(FlatDomainRank(g, t, T), flat[g][t]);
          std::vector<int> want_gtp, want_tp;
          for (int g2 = 0; g2 < G; ++g2) want_gtp.push_back(flat[g2][t]);
          for (int t2 = 0; t2 < T; ++t2) want_tp.push_back(flat[g][t2]);
          EXPECT_EQ(groups->gtp_remat_ranks, want_gtp);
          EXPECT_EQ(groups->tp_ranks, want_tp);
          EXPECT_EQ(groups->gtp_remat_ranks[groups->gtp_remat_rank],
                    flat[g][t]);
          EXPECT_EQ(groups->tp_ranks[groups->tp_rank], flat[g][t]);
          EXPECT_EQ(groups->gtp_remat_prefix,
                    "j/d/v1/gtp_remat/t" + std::to_string(t));
          EXPECT_EQ(groups->tp_prefix, "j/d/v1/tp/g" + std::to_string(g));
          prefixes.insert(groups->gtp_remat_prefix);
          prefixes.insert(groups->tp_prefix);
        }
      }
      // One prefix per distinct group: T gtp_remat groups and G tp groups.
      EXPECT_EQ(prefixes.size(), static_cast<size_t>(G + T));
    }
  }
}

// With a DP axis: the gtp_remat and tp groups stay within replica d (flat
// ranks (d * G + g) * T + t, prefixes naming d), the dp group is
// {(d', g, t)}; every distinct group has its own prefix, so replicas never
// meet in the gtp_remat or tp rendezvous.
TEST(SplitDomain, DpAxisGroupsPerReplica) {
  for (int D = 2; D <= 3; ++D) {
    for (int G = 1; G <= 2; ++G) {
      for (int T = 1; T <= 2; ++T) {
        const DomainSize size{G, T, D};
        std::set<std::string> gtp_prefixes, tp_prefixes, dp_prefixes;
        for (int d = 0; d < D; ++d) {
          for (int g = 0; g < G; ++g) {
            for (int t = 0; t < T; ++t) {
              SCOPED_TRACE(::testing::Message()
                           << D << "x" << G << "x" << T << " at (" << d << ","
                           << g << "," << t << ")");
              absl::StatusOr<DomainGroups> groups =
                  SplitDomain(size, d, g, t, "j/d/v1");
              ASSERT_TRUE(groups.ok()) << groups.status();
              const int me = (d * G + g) * T + t;
              std::vector<int> want_gtp, want_tp, want_dp;
              for (int g2 = 0; g2 < G; ++g2)
                want_gtp.push_back((d * G + g2) * T + t);
              for (int t2 = 0; t2 < T; ++t2)
                want_tp.push_back((d * G + g) * T + t2);
              for (int d2 = 0; d2 < D; ++d2)
                want_dp.push_back((d2 * G + g) * T + t);
              EXPECT_EQ(groups->gtp_remat_ranks, want_gtp);
              EXPECT_EQ(groups->tp_ranks, want_tp);
              EXPECT_EQ(groups->dp_ranks, want_dp);
              EXPECT_EQ(groups->dp_ranks[groups->dp_rank], me);
              EXPECT_EQ(groups->gtp_remat_prefix,
                        "j/d/v1/d" + std::to_string(d) + "/gtp_remat/t" +
                            std::to_string(t));
              EXPECT_EQ(groups->tp_prefix, "j/d/v1/d" + std::to_string(d) +
                                               "/tp/g" + std::to_string(g));
              gtp_prefixes.insert(groups->gtp_remat_prefix);
              tp_prefixes.insert(groups->tp_prefix);
              dp_prefixes.insert(groups->dp_prefix);
            }
          }
        }
        // D * T gtp_remat groups, D * G tp groups, G * T dp groups, all
        // distinct.
        EXPECT_EQ(gtp_prefixes.size(), size_t(D * T));
        EXPECT_EQ(tp_prefixes.size(), size_t(D * G));
        EXPECT_EQ(dp_prefixes.size(), size_t(G * T));
        std::set<std::string> all = gtp_prefixes;
        all.insert(tp_prefixes.begin(), tp_prefixes.end());
        all.insert(dp_prefixes.begin(), dp_prefixes.end());
        EXPECT_EQ(all.size(), size_t(D * T + D * G + G * T));
      }
    }
  }
  EXPECT_EQ(SplitDomain(DomainSize{1, 1, 2}, 2, 0, 0, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitDomain(DomainSize{1, 1, 0}, 0, 0, 0, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SplitDomain, RejectsBadSizesAndCoordinates) {
  EXPECT_EQ(SplitDomain(0, 2, 0, 0, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitDomain(2, 0, 0, 0, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitDomain(2, 2, 2, 0, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(SplitDomain(2, 2, 0, -1, "p").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace muond
