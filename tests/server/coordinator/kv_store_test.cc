// CoordinatorCore in-process. The rendezvous store: KvGet blocks until the key
// is set or times out, and every KvLimits bound is enforced naming its flag.
// Plans come from the real core planner (PlanGroup).
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

TEST(KvStore, KvGetBlocksUntilSetAndTimesOut) {
  CoordinatorCore core(Options());
  JoinAll(core, "j", 1);
  v1::KvGetRequest get;
  get.set_job_id("j");
  get.set_key("gloo/addr");
  get.set_timeout_ms(20);
  absl::StatusOr<std::string> missing = core.KvGet(get);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(missing.status().message(), HasSubstr("gloo/addr"));

  get.set_timeout_ms(10000);
  std::thread setter([&core] {
    absl::SleepFor(absl::Milliseconds(50));
    v1::KvSetRequest set;
    set.set_job_id("j");
    set.set_key("gloo/addr");
    set.set_value(std::string("a\0b", 3));
    ASSERT_TRUE(core.KvSet(set).ok());
  });
  absl::StatusOr<std::string> value = core.KvGet(get);
  setter.join();
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, std::string("a\0b", 3));
}

TEST(KvStore, KvStoreIsBounded) {
  CoordinatorOptions o = Options();
  o.kv.max_value_bytes = 100;
  o.kv.max_key_bytes = 10;
  o.kv.max_keys_per_job = 3;
  o.kv.max_total_bytes = 250;
  CoordinatorCore core(o);
  JoinAll(core, "j", 1);
  auto set = [&core](const std::string& key, size_t bytes) {
    v1::KvSetRequest r;
    r.set_job_id("j");
    r.set_key(key);
    r.set_value(std::string(bytes, 'x'));
    return core.KvSet(r);
  };
  auto exhausted = [](const absl::Status& st, const std::string& limit) {
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << limit;
    EXPECT_THAT(st.message(), HasSubstr(limit));
  };
  exhausted(set("a", 101), "kv_max_value_bytes=100");
  exhausted(set(std::string(11, 'k'), 1), "kv_max_key_bytes=10");
  ASSERT_TRUE(set("a", 100).ok());
  ASSERT_TRUE(set("b", 100).ok());
  exhausted(set("c", 100), "kv_max_total_bytes=250");
  ASSERT_TRUE(set("c", 10).ok());
  exhausted(set("d", 1), "kv_max_keys_per_job=3");
  // Overwriting a key counts its new size only.
  EXPECT_TRUE(set("a", 50).ok());
  EXPECT_TRUE(set("c", 40).ok());
}

}  // namespace
}  // namespace muond
