// The open-file limit: the servers raise the soft RLIMIT_NOFILE to the hard
// one at start, and a daemon out of descriptors refuses a region
// RESOURCE_EXHAUSTED naming it, the count, the limit and what to change.
#include "server/common/open_files.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/daemon/memory_mapper.h"

namespace muond {
namespace {

using ::testing::HasSubstr;

// Sets the soft limit for the test and restores the original afterwards.
class SoftLimit {
 public:
  explicit SoftLimit(rlim_t soft) {
    EXPECT_EQ(getrlimit(RLIMIT_NOFILE, &saved_), 0);
    struct rlimit lowered = saved_;
    lowered.rlim_cur = soft;
    EXPECT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  }
  ~SoftLimit() { setrlimit(RLIMIT_NOFILE, &saved_); }
  rlim_t hard() const { return saved_.rlim_max; }

 private:
  struct rlimit saved_;
};

rlim_t SoftLimitNow() {
  struct rlimit now;
  EXPECT_EQ(getrlimit(RLIMIT_NOFILE, &now), 0);
  return now.rlim_cur;
}

TEST(OpenFiles, TheSoftLimitIsRaisedToTheHardLimit) {
  struct rlimit start;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &start), 0);
  if (start.rlim_max != RLIM_INFINITY && start.rlim_max < 128) {
    GTEST_SKIP() << "hard limit " << start.rlim_max
                 << " leaves nothing to raise";
  }
  SoftLimit lowered(64);
  absl::StatusOr<OpenFileLimit> limit = RaiseOpenFileLimit();
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_EQ(limit->soft_before, 64u);
  EXPECT_EQ(limit->hard, lowered.hard());
  EXPECT_EQ(limit->soft, SoftLimitNow());
  if (lowered.hard() != RLIM_INFINITY)
    EXPECT_EQ(SoftLimitNow(), lowered.hard());
  EXPECT_GT(SoftLimitNow(), 64u);
  EXPECT_THAT(DescribeOpenFileLimit(*limit),
              HasSubstr(absl::StrCat("(was 64), hard limit ")));
}

TEST(OpenFiles, ARegionPastTheLimitIsResourceExhaustedNamingWhatToChange) {
  const std::string name = absl::StrCat("/muond-open-files-", getpid());
  const int object = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(object, 0);
  ASSERT_EQ(ftruncate(object, 4096), 0);
  close(object);

  absl::StatusOr<std::unique_ptr<MappedRegion>> mapped;
  {
    // Every descriptor under a low soft limit taken, as by a registration
    // of one region per param.
    SoftLimit lowered(64);
    std::vector<int> held;
    for (int fd; (fd = open("/dev/null", O_RDONLY | O_CLOEXEC)) >= 0;) {
      held.push_back(fd);
    }
    HandleOpener opener;
    mapped = opener.OpenShm(name, 4096, "region 'r7'");
    for (int fd : held) close(fd);
  }
  shm_unlink(name.c_str());
  ASSERT_FALSE(mapped.ok());
  EXPECT_EQ(mapped.status().code(), absl::StatusCode::kResourceExhausted)
      << mapped.status();
  const std::string message(mapped.status().message());
  EXPECT_THAT(message, HasSubstr("region 'r7': cannot open shm object"));
  EXPECT_THAT(message, HasSubstr("Too many open files"));
  EXPECT_THAT(message, HasSubstr("open files of its soft limit 64"));
  EXPECT_THAT(message, HasSubstr("ulimit -n"));
  EXPECT_THAT(message, HasSubstr("LimitNOFILE="));
}

TEST(OpenFiles, OtherErrorsGetNoAdvice) {
  EXPECT_EQ(OpenFilesAdvice(ENOENT), "");
  EXPECT_THAT(OpenFilesAdvice(ENFILE), HasSubstr("fs.file-max"));
}

}  // namespace
}  // namespace muond
