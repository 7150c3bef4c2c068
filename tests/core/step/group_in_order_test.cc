// GroupInOrder against groupings written out by hand.
#include "core/step/group_in_order.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace muond {
namespace {

using Groups = std::vector<std::vector<size_t>>;

TEST(GroupInOrder, GroupsInOrderOfTheirFirstIndexMembersAscending) {
  const std::vector<std::string> keys = {"b", "a", "b", "c", "a", "b"};
  const Groups got = GroupInOrder(
      keys.size(), [](size_t) { return true; },
      [&](size_t a, size_t b) { return keys[a] == keys[b]; });
  EXPECT_EQ(got, (Groups{{0, 2, 5}, {1, 4}, {3}}));
}

TEST(GroupInOrder, LeftOutIndicesAreInNoGroup) {
  const std::vector<int> keys = {7, 0, 7, 3, 0, 3};
  const Groups got = GroupInOrder(
      keys.size(), [&](size_t i) { return keys[i] != 0; },
      [&](size_t a, size_t b) { return keys[a] == keys[b]; });
  EXPECT_EQ(got, (Groups{{0, 2}, {3, 5}}));
  EXPECT_TRUE(
      GroupInOrder(
          0, [](size_t) { return true; }, [](size_t, size_t) { return true; })
          .empty());
}

}  // namespace
}  // namespace muond
