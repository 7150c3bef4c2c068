#include "core/comm/kv_store.h"

#include <dirent.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/core/comm/multiprocess.h"

namespace muond {
namespace {

using ::muond::testing::MakeTempDir;
using ::muond::testing::RunRanks;

const std::string kBinary("a\0b\xff\n", 5);

// Semantics every store must have, run against each implementation.
void ExpectStoreSemantics(KeyValueStore& store) {
  ASSERT_TRUE(store.Set("plain", "v1").ok());
  EXPECT_EQ(*store.Get("plain", absl::Seconds(5)), "v1");
  ASSERT_TRUE(store.Set("plain", "v2").ok());  // overwrite
  EXPECT_EQ(*store.Get("plain", absl::Seconds(5)), "v2");

  // Keys with separators and odd bytes, binary values, empty values.
  ASSERT_TRUE(store.Set("job/dense/v3/.x%y z", kBinary).ok());
  EXPECT_EQ(*store.Get("job/dense/v3/.x%y z", absl::Seconds(5)), kBinary);
  ASSERT_TRUE(store.Set("empty", "").ok());
  EXPECT_EQ(*store.Get("empty", absl::Seconds(5)), "");

  // A missing key times out with DeadlineExceeded naming the key.
  absl::StatusOr<std::string> missing =
      store.Get("never/set-key", absl::Milliseconds(30));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(missing.status().message().find("never/set-key"), std::string::npos)
      << missing.status();

  // Get blocks until another thread sets the key.
  std::thread setter([&store] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store.Set("late", "arrived").ok());
  });
  absl::StatusOr<std::string> late = store.Get("late", absl::Seconds(20));
  setter.join();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(*late, "arrived");

  // Prefixes namespace keys, nest, and map onto "<prefix>/<key>".
  PrefixStore a(&store, "job/a");
  PrefixStore b(&store, "job/b");
  PrefixStore a_inner(&a, "inner");
  ASSERT_TRUE(a.Set("k", "from a").ok());
  ASSERT_TRUE(b.Set("k", "from b").ok());
  ASSERT_TRUE(a_inner.Set("k", "from a/inner").ok());
  EXPECT_EQ(*a.Get("k", absl::Seconds(5)), "from a");
  EXPECT_EQ(*b.Get("k", absl::Seconds(5)), "from b");
  EXPECT_EQ(*store.Get("job/a/k", absl::Seconds(5)), "from a");
  EXPECT_EQ(*store.Get("job/a/inner/k", absl::Seconds(5)), "from a/inner");
  absl::StatusOr<std::string> other =
      b.Get("only-in-a", absl::Milliseconds(10));
  ASSERT_TRUE(a.Set("only-in-a", "x").ok());
  other = b.Get("only-in-a", absl::Milliseconds(10));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(other.status().message().find("job/b/only-in-a"), std::string::npos)
      << other.status();
}

TEST(InMemoryKeyValueStore, Semantics) {
  InMemoryKeyValueStore store;
  ExpectStoreSemantics(store);
}

TEST(FileKeyValueStore, Semantics) {
  const std::string dir = MakeTempDir();
  ASSERT_FALSE(dir.empty());
  FileKeyValueStore store(dir);
  ExpectStoreSemantics(store);
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  closedir(d);
  return names;
}

TEST(FileKeyValueStore, LeavesNoTemporaryFiles) {
  const std::string dir = MakeTempDir();
  FileKeyValueStore store(dir);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(store.Set("k", "value").ok());
  ASSERT_TRUE(store.Set("a/b", "value").ok());
  std::vector<std::string> names = ListDir(dir);
  EXPECT_EQ(names.size(), 2u);
  for (const std::string& name : names) EXPECT_NE(name[0], '.') << name;
}

TEST(FileKeyValueStore, KeyTooLongForAFileNameIsInvalid) {
  FileKeyValueStore store(MakeTempDir());
  const std::string key(300, 'k');
  EXPECT_EQ(store.Set(key, "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store.Get(key, absl::Milliseconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FileKeyValueStore, MissingDirectoryIsAnError) {
  FileKeyValueStore store(MakeTempDir() + "/does-not-exist");
  absl::Status st = store.Set("k", "v");
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("does-not-exist"), std::string::npos) << st;
}

// Get in one process returns the value another process sets later; large
// values arrive whole (the rename makes the write atomic).
TEST(FileKeyValueStore, AcrossProcesses) {
  const std::string dir = MakeTempDir();
  const std::string big(1 << 20, 'z');
  std::vector<int> codes = RunRanks(2, [&](int rank) {
    FileKeyValueStore store(dir);
    if (rank == 1) {
      absl::SleepFor(absl::Milliseconds(100));
      return store.Set("big", big).ok() ? 0 : 1;
    }
    absl::StatusOr<std::string> value = store.Get("big", absl::Seconds(20));
    if (!value.ok()) return 2;
    return *value == big ? 0 : 3;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

TEST(CancellableStore, PassesValuesThroughAndTimesOutLikeItsBase) {
  InMemoryKeyValueStore base;
  std::atomic<bool> cancel{false};
  CancellableStore store(
      &base, [&] { return cancel.load(); }, absl::Milliseconds(5));
  ASSERT_TRUE(store.Set("a", "1").ok());
  EXPECT_EQ(*base.Get("a", absl::ZeroDuration()), "1");
  // Set by another thread after several slices have passed.
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(40));
    ASSERT_TRUE(base.Set("b", "2").ok());
  });
  absl::StatusOr<std::string> b = store.Get("b", absl::Seconds(30));
  late.join();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*b, "2");
  absl::StatusOr<std::string> c = store.Get("c", absl::Milliseconds(30));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(c.status().message().find("key 'c' was not set within 30ms"),
            std::string::npos)
      << c.status();
}

TEST(CancellableStore, StopsWaitingOnceCancelled) {
  InMemoryKeyValueStore base;
  std::atomic<bool> cancel{false};
  CancellableStore store(
      &base, [&] { return cancel.load(); }, absl::Milliseconds(5));
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(20));
    cancel = true;
  });
  // Far longer than the test may take: only the cancellation ends it.
  absl::StatusOr<std::string> got = store.Get("never", absl::Hours(1));
  canceller.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kCancelled) << got.status();
  EXPECT_NE(got.status().message().find("key 'never'"), std::string::npos);
}

}  // namespace
}  // namespace muond
