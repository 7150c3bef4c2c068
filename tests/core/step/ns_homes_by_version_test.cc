// The NS homes a group keeps by plan version: lookup, newest/oldest, the
// one-plan-per-version rule and the retention of the newest kCapacity.
#include "core/step/ns_homes_by_version.h"

#include <vector>

#include "gtest/gtest.h"

namespace muond {
namespace {

std::vector<NsHome> Homes(int g) { return {NsHome{g, 0}, NsHome{0, 0}}; }

TEST(NsHomesByVersion, EmptyHoldsNothing) {
  NsHomesByVersion store;
  EXPECT_EQ(store.size(), 0u);
  EXPECT_EQ(store.newest(), 0);
  EXPECT_EQ(store.oldest(), 0);
  EXPECT_EQ(store.Find(1), nullptr);
}

TEST(NsHomesByVersion, FindsEachVersionsHomes) {
  NsHomesByVersion store;
  ASSERT_TRUE(store.Put(3, Homes(1)).ok());
  ASSERT_TRUE(store.Put(5, Homes(2)).ok());
  ASSERT_NE(store.Find(3), nullptr);
  EXPECT_EQ(*store.Find(3), Homes(1));
  EXPECT_EQ(*store.Find(5), Homes(2));
  EXPECT_EQ(store.Find(4), nullptr);
  EXPECT_EQ(store.newest(), 5);
  EXPECT_EQ(store.oldest(), 3);
}

TEST(NsHomesByVersion, AVersionNamesOnePlan) {
  NsHomesByVersion store;
  ASSERT_TRUE(store.Put(2, Homes(1)).ok());
  EXPECT_TRUE(store.Put(2, Homes(1)).ok());
  const absl::Status s = store.Put(2, Homes(3));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*store.Find(2), Homes(1));
  EXPECT_EQ(store.size(), 1u);
}

TEST(NsHomesByVersion, KeepsTheNewestCapacityVersions) {
  NsHomesByVersion store;
  const int64_t n = NsHomesByVersion::kCapacity + 3;
  for (int64_t v = 1; v <= n; ++v) ASSERT_TRUE(store.Put(v, Homes(0)).ok());
  EXPECT_EQ(store.size(), NsHomesByVersion::kCapacity);
  EXPECT_EQ(store.newest(), n);
  EXPECT_EQ(store.oldest(), n - int64_t(NsHomesByVersion::kCapacity) + 1);
  EXPECT_EQ(store.Find(3), nullptr);
  // A version older than every kept one is not kept.
  ASSERT_TRUE(store.Put(1, Homes(0)).ok());
  EXPECT_EQ(store.Find(1), nullptr);
  EXPECT_EQ(store.oldest(), n - int64_t(NsHomesByVersion::kCapacity) + 1);
}

}  // namespace
}  // namespace muond
