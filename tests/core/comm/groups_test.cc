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
