// Step channels against a trainer written from step_channel_layout.h alone:
// steps and refusals answered as the Step RPC answers them, every header
// rule refused by name, and a trainer that vanishes, shrinks the object or
// writes garbage ends its channel or gets a refusal, never a crashed daemon.
#include "server/daemon/step_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/common/error_reason.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "muond/v1/error_details.pb.h"
#include "proto/status_details.h"
#include "proto/step_channel_layout.h"

namespace muond {
namespace {

namespace sc = step_channel;
using ::testing::HasSubstr;

constexpr uint32_t kCapacity = sc::kMinCapacity;

// The trainer's side, as a client in any language would write it.
class Trainer {
 public:
  explicit Trainer(uint32_t request_capacity = kCapacity,
                   uint32_t response_capacity = kCapacity)
      // The clock too: sandboxed test runs may share pids.
      : name_(absl::StrCat("/muond-step-channel-test-", getpid(), "-",
                           absl::ToUnixNanos(absl::Now()), "-", counter_++)),
        size_(sc::ResponseOffset(request_capacity) + response_capacity),
        request_capacity_(request_capacity),
        response_capacity_(response_capacity) {
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size_)), 0);
    base_ = static_cast<char*>(
        mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
    EXPECT_NE(base_, MAP_FAILED);
    Put<uint64_t>(sc::kMagicOffset, sc::kMagic);
    Put<uint32_t>(sc::kVersionOffset, sc::kVersion);
    Put<uint32_t>(sc::kRequestCapacityOffset, request_capacity);
    Put<uint32_t>(sc::kResponseCapacityOffset, response_capacity);
    struct flock lock = {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    lock.l_start = sc::kTrainerLockByte;
    lock.l_len = 1;
    EXPECT_EQ(fcntl(fd_, F_OFD_SETLK, &lock), 0);
  }
  ~Trainer() {
    Vanish();
    shm_unlink(name_.c_str());
  }

  v1::OpenStepChannelRequest OpenRequest() const {
    v1::OpenStepChannelRequest request;
    request.set_shm_name(name_);
    return request;
  }

  template <typename T>
  void Put(uint64_t offset, T value) {
    std::memcpy(base_ + offset, &value, sizeof value);
  }
  template <typename T>
  T Get(uint64_t offset) const {
    T value;
    std::memcpy(&value, base_ + offset, sizeof value);
    return value;
  }

  // Sends `op` with the request bytes and returns the new sequence number.
  uint32_t Send(const std::string& bytes, uint32_t op = sc::kOpStep,
                uint32_t len_override = UINT32_MAX) {
    std::memcpy(base_ + sc::kRequestOffset, bytes.data(), bytes.size());
    Put<uint32_t>(sc::kRequestLenOffset, len_override == UINT32_MAX
                                             ? uint32_t(bytes.size())
                                             : len_override);
    Put<uint32_t>(sc::kRequestOpOffset, op);
    const uint32_t seq = Get<uint32_t>(sc::kRequestSeqOffset) + 1;
    __atomic_store_n(reinterpret_cast<uint32_t*>(base_ + sc::kRequestSeqOffset),
                     seq, __ATOMIC_RELEASE);
    syscall(SYS_futex, base_ + sc::kRequestSeqOffset, FUTEX_WAKE, 1, nullptr,
            nullptr, 0);
    return seq;
  }

  // The verdict on the step of `seq` (a step sent with
  // await_trainer_verdict): the verdict, then its sequence number, then a
  // wake.
  void Verdict(uint32_t seq, uint32_t verdict) {
    Put<uint32_t>(sc::kVerdictOffset, verdict);
    __atomic_store_n(reinterpret_cast<uint32_t*>(base_ + sc::kVerdictSeqOffset),
                     seq, __ATOMIC_RELEASE);
    syscall(SYS_futex, base_ + sc::kVerdictSeqOffset, FUTEX_WAKE, 1, nullptr,
            nullptr, 0);
  }

  // Waits (futex) for the answer to `seq`; false after `within`.
  bool Await(uint32_t seq, absl::Duration within = absl::Seconds(10)) {
    const absl::Time deadline = absl::Now() + within;
    auto* word = reinterpret_cast<uint32_t*>(base_ + sc::kResponseSeqOffset);
    while (absl::Now() < deadline) {
      const uint32_t now = __atomic_load_n(word, __ATOMIC_ACQUIRE);
      if (now == seq) return true;
      struct timespec slice = {0, 50'000'000};
      syscall(SYS_futex, word, FUTEX_WAIT, now, &slice, nullptr, 0);
    }
    return false;
  }

  uint32_t kind() const { return Get<uint32_t>(sc::kResponseKindOffset); }
  std::string Answer() const {
    return std::string(base_ + sc::ResponseOffset(request_capacity_),
                       Get<uint32_t>(sc::kResponseLenOffset));
  }
  v1::StepResponse Response() const {
    v1::StepResponse response;
    EXPECT_EQ(kind(), sc::kStepResponse);
    EXPECT_TRUE(response.ParseFromString(Answer()));
    return response;
  }
  v1::RpcStatus Refusal() const {
    v1::RpcStatus status;
    EXPECT_EQ(kind(), sc::kRpcStatus);
    EXPECT_TRUE(status.ParseFromString(Answer()));
    return status;
  }

  // The trainer's process ends: its mapping and lock go.
  void Vanish() {
    if (base_ != MAP_FAILED && base_ != nullptr) munmap(base_, size_);
    if (fd_ >= 0) close(fd_);
    base_ = nullptr;
    fd_ = -1;
  }
  int fd() const { return fd_; }
  char* base() const { return base_; }

 private:
  static inline std::atomic<int> counter_{0};
  std::string name_;
  uint64_t size_;
  uint32_t request_capacity_;
  uint32_t response_capacity_;
  int fd_ = -1;
  char* base_ = nullptr;
};

std::string StepBytes(int64_t step_id, bool await_verdict = false) {
  v1::StepRequest request;
  request.set_job_id("job");
  request.set_step_id(step_id);
  request.set_await_trainer_verdict(await_verdict);
  return request.SerializeAsString();
}

// Answers step_id back (after the trainer's verdict, for a step sent
// before its checks); step 13 is refused with a reason; step 99 answers
// with more than a 64 KiB response area holds.
absl::StatusOr<v1::StepResponse> EchoHandler(
    const v1::StepRequest& request, const TrainerVerdict& verdict = {}) {
  if (request.await_trainer_verdict()) {
    if (absl::Status said = verdict(); !said.ok()) return said;
  }
  if (request.step_id() == 13) {
    return WithErrorReason(
        absl::InvalidArgumentError("group 0/param w: non-finite gradient"),
        ErrorReason::kTrainerRefused, {{"ranks", "0"}});
  }
  v1::StepResponse response;
  response.set_step_id(request.step_id());
  if (request.step_id() == 99) {
    for (int i = 0; i < 2000; ++i) {
      response.add_skipped_nonfinite(std::string(64, 'p'));
    }
  }
  return response;
}

StepChannelOptions FastOptions(int max_channels = 4) {
  StepChannelOptions options;
  options.max_channels = max_channels;
  options.idle_check = absl::Milliseconds(20);
  options.slot_wait = absl::Milliseconds(100);
  return options;
}

bool EventuallyOpen(const StepChannels& channels, int want) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (channels.open_channels() != want && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  return channels.open_channels() == want;
}

TEST(StepChannelTest, StepsAreAnsweredInOrder) {
  StepChannels channels(EchoHandler, FastOptions());
  Trainer trainer;
  absl::StatusOr<v1::OpenStepChannelResponse> opened =
      channels.Open(trainer.OpenRequest());
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ(opened->version(), sc::kVersion);
  for (int64_t step = 1; step <= 50; ++step) {
    if (step == 13) continue;
    const uint32_t seq = trainer.Send(StepBytes(step));
    ASSERT_TRUE(trainer.Await(seq)) << "step " << step;
    EXPECT_EQ(trainer.Response().step_id(), step);
  }
  EXPECT_EQ(channels.open_channels(), 1);
}

// CLOCK_MONOTONIC in microseconds, the clock of StepTimings.received_at_us
// and answered_at_us.
int64_t MonotonicMicros() {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t(now.tv_sec) * 1000000 + now.tv_nsec / 1000;
}

StepChannelOptions PollingOptions(absl::Duration poll) {
  StepChannelOptions options = FastOptions();
  options.request_poll = poll;
  return options;
}

// A channel that polls for its trainer's requests answers them as one that
// sleeps does: at the trainer's period (in the poll's window), early (before
// it) and late (after it: the window spent, back on the futex). Every answer
// is stamped on the trainer's clock between its posting and its return.
TEST(StepChannelTest, PollingChannelAnswersRequestsOnTimeEarlyAndLate) {
  StepChannels channels(EchoHandler, PollingOptions(absl::Milliseconds(2)));
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  const int gaps_ms[] = {10, 10, 10, 10, 0, 10, 10, 60, 10, 10};
  int64_t step = 1;
  for (const int gap : gaps_ms) {
    absl::SleepFor(absl::Milliseconds(gap));
    const int64_t posted = MonotonicMicros();
    ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(step))))
        << "step " << step;
    const int64_t returned = MonotonicMicros();
    const v1::StepResponse answer = trainer.Response();
    EXPECT_EQ(answer.step_id(), step);
    EXPECT_LE(posted, answer.timings().received_at_us()) << "step " << step;
    EXPECT_LE(answer.timings().received_at_us(),
              answer.timings().answered_at_us());
    EXPECT_LE(answer.timings().answered_at_us(), returned) << "step " << step;
    ++step;
  }
  EXPECT_EQ(channels.open_channels(), 1);
}

// At a steady period the daemon finds requests by polling (a poll of 5 ms
// around each request, due 30 ms after the last answer: an oversleep of the
// trainer past 5 ms on every one of six would miss them all); asleep, never.
TEST(StepChannelTest, RequestsAtASteadyPeriodAreFoundByPolling) {
  for (const absl::Duration poll :
       {absl::ZeroDuration(), absl::Milliseconds(5)}) {
    StepChannels channels(EchoHandler, PollingOptions(poll));
    Trainer trainer;
    ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
    for (int64_t step = 1; step <= 8; ++step) {
      absl::SleepFor(absl::Milliseconds(30));
      ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(step))));
      EXPECT_EQ(trainer.Response().step_id(), step);
    }
    if (poll == absl::ZeroDuration()) {
      EXPECT_EQ(channels.requests_polled(), 0);
    } else {
      EXPECT_GE(channels.requests_polled(), 1);
    }
  }
}

// The daemon's own step varies (here 2 ms, then 40 ms, in turn) while the
// trainer's turn does not (20 ms): the window placed by the answer still
// finds the requests. Placed by the interval between the last two requests
// (22 ms, then 60, in turn) it would be 38 ms off every time: none found.
TEST(StepChannelTest, RequestsAreFoundByPollingWhenTheStepVaries) {
  std::atomic<int64_t> handled{0};
  const auto varying_step = [&handled](const v1::StepRequest& request,
                                       const TrainerVerdict& verdict) {
    absl::SleepFor(absl::Milliseconds(++handled % 2 == 0 ? 40 : 2));
    return EchoHandler(request, verdict);
  };
  StepChannels channels(varying_step, PollingOptions(absl::Milliseconds(5)));
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  constexpr int64_t kSteps = 16;
  for (int64_t step = 101; step <= 100 + kSteps; ++step) {  // plain steps
    absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(step))));
    EXPECT_EQ(trainer.Response().step_id(), step);
  }
  // The first two requests set the turn; a loaded machine may miss a few.
  EXPECT_GE(channels.requests_polled(), kSteps / 2);
}

// A trainer that vanishes or shrinks its object while the daemon polls for
// its next request ends the channel, as one asleep on the futex does.
TEST(StepChannelTest, TrainerGoneWhilePolledForEndsItsChannel) {
  for (const bool shrink : {false, true}) {
    SCOPED_TRACE(shrink ? "shrunk" : "vanished");
    // Polling from 40 ms before the third request is due to 40 ms after.
    StepChannels channels(EchoHandler, PollingOptions(absl::Milliseconds(40)));
    Trainer trainer;
    ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
    ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(1))));
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(2))));
    absl::SleepFor(absl::Milliseconds(70));  // inside the window
    if (shrink) {
      ASSERT_EQ(ftruncate(trainer.fd(), 0), 0);
    } else {
      trainer.Vanish();
    }
    EXPECT_TRUE(EventuallyOpen(channels, 0));
  }
}

TEST(StepChannelTest, RefusalIsTheStepRpcsStatus) {
  StepChannels channels(EchoHandler, FastOptions());
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(13))));
  const v1::RpcStatus refusal = trainer.Refusal();
  v1::StepRequest thirteen;
  thirteen.set_step_id(13);
  EXPECT_EQ(trainer.Answer(), ToRpcStatusBytes(EchoHandler(thirteen).status()));
  EXPECT_EQ(refusal.code(), 3);
  EXPECT_THAT(refusal.message(), HasSubstr("param w"));
  ASSERT_EQ(refusal.details_size(), 1);
  v1::ErrorInfo info;
  ASSERT_TRUE(info.ParseFromString(refusal.details(0).value()));
  EXPECT_EQ(info.reason(), "TRAINER_REFUSED");
  EXPECT_EQ(info.metadata().at("ranks"), "0");
  // The channel goes on after a refusal.
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(14))));
  EXPECT_EQ(trainer.Response().step_id(), 14);
}

TEST(StepChannelTest, AnswerTooLargeSaysItsSize) {
  StepChannels channels(EchoHandler, FastOptions());
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(99))));
  EXPECT_EQ(trainer.kind(), sc::kTooLarge);
  v1::StepRequest request;
  request.set_step_id(99);
  EXPECT_EQ(trainer.Get<uint32_t>(sc::kResponseLenOffset),
            EchoHandler(request)->ByteSizeLong());
}

// The answer too large for the channel is kept for the Step RPC of the
// same request (once), which must return it as it was rather than run the
// step again; another request, or the channel's next one, does not get it.
TEST(StepChannelTest, AnswerTooLargeIsKeptForTheSameRequestOnce) {
  int handled = 0;
  StepChannels channels(
      [&](const v1::StepRequest& request, const TrainerVerdict& verdict) {
        ++handled;
        absl::StatusOr<v1::StepResponse> answer = EchoHandler(request, verdict);
        answer->set_plan_version(handled);  // which call answered
        return answer;
      },
      FastOptions());
  Trainer trainer;
  absl::StatusOr<v1::OpenStepChannelResponse> opened =
      channels.Open(trainer.OpenRequest());
  ASSERT_TRUE(opened.ok());
  EXPECT_TRUE(opened->answers_kept());
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(99))));
  ASSERT_EQ(trainer.kind(), sc::kTooLarge);
  v1::StepRequest request, other;
  ASSERT_TRUE(request.ParseFromString(StepBytes(99)));
  ASSERT_TRUE(other.ParseFromString(StepBytes(98)));
  EXPECT_EQ(channels.TakeKeptAnswer(other), std::nullopt);
  std::optional<absl::StatusOr<v1::StepResponse>> kept =
      channels.TakeKeptAnswer(request);
  ASSERT_TRUE(kept.has_value() && kept->ok());
  EXPECT_EQ((*kept)->step_id(), 99);
  EXPECT_EQ((*kept)->plan_version(), 1);
  EXPECT_EQ((*kept)->skipped_nonfinite_size(), 2000);
  EXPECT_EQ(channels.TakeKeptAnswer(request), std::nullopt);  // once
  EXPECT_EQ(handled, 1);
  // Kept again by the next too-large answer; dropped by the request after.
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(99))));
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(5))));
  EXPECT_EQ(channels.TakeKeptAnswer(request), std::nullopt);
}

TEST(StepChannelTest, MalformedRequestsAreRefusedByRule) {
  StepChannels channels(EchoHandler, FastOptions());
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  struct Case {
    std::string bytes;
    uint32_t op;
    uint32_t len;
    const char* says;
  } cases[] = {
      {StepBytes(1), 7, UINT32_MAX, "request_op 7"},
      {StepBytes(1), sc::kOpStep, kCapacity + 1, "exceeds the channel's"},
      {std::string("\xff\xff\xff\xff\x0f", 5), sc::kOpStep, UINT32_MAX,
       "not a muond.v1.StepRequest"},
  };
  for (const Case& c : cases) {
    ASSERT_TRUE(trainer.Await(trainer.Send(c.bytes, c.op, c.len)));
    const v1::RpcStatus refusal = trainer.Refusal();
    EXPECT_EQ(refusal.code(), 3) << c.says;
    EXPECT_THAT(refusal.message(), HasSubstr(c.says));
  }
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(2))));
  EXPECT_EQ(trainer.Response().step_id(), 2);
}

TEST(StepChannelTest, HeaderRulesAreRefusedByName) {
  StepChannels channels(EchoHandler, FastOptions());
  struct Case {
    uint64_t offset;
    uint64_t value;
    int width;
    const char* says;
  } cases[] = {
      {sc::kMagicOffset, 42, 8, "magic"},
      {sc::kVersionOffset, 9, 4, "layout version 9"},
      {sc::kRequestCapacityOffset, 4096, 4, "request_capacity 4096"},
      {sc::kResponseCapacityOffset, kCapacity + 1, 4, "response_capacity"},
      {sc::kResponseCapacityOffset, 2 * kCapacity, 4, "capacities need"},
  };
  for (const Case& c : cases) {
    Trainer trainer;
    if (c.width == 8) {
      trainer.Put<uint64_t>(c.offset, c.value);
    } else {
      trainer.Put<uint32_t>(c.offset, uint32_t(c.value));
    }
    absl::StatusOr<v1::OpenStepChannelResponse> opened =
        channels.Open(trainer.OpenRequest());
    EXPECT_TRUE(absl::IsInvalidArgument(opened.status())) << c.says;
    EXPECT_THAT(opened.status().message(), HasSubstr(c.says));
  }
  v1::OpenStepChannelRequest missing;
  missing.set_shm_name("/muond-step-channel-test-no-such-object");
  EXPECT_TRUE(absl::IsNotFound(channels.Open(missing).status()));
  v1::OpenStepChannelRequest escaping;
  escaping.set_shm_name("/../etc/passwd");
  EXPECT_TRUE(absl::IsInvalidArgument(channels.Open(escaping).status()));
  EXPECT_EQ(channels.open_channels(), 0);
}

// Names that are no channel object: each refused with its rule, none a
// retryable UNAVAILABLE.
TEST(StepChannelTest, ObjectsThatAreNoChannelAreRefusedByRule) {
  StepChannels channels(EchoHandler, FastOptions());
  Trainer trainer;
  const std::string base =
      absl::StrCat("muond-step-channel-test-odd-", getpid(), "-",
                   absl::ToUnixNanos(absl::Now()));
  const std::string link = "/dev/shm/" + base + "-link";
  const std::string dir = "/dev/shm/" + base + "-dir";
  const std::string tiny = "/" + base + "-tiny";
  // Removed however the test ends (an ASSERT returns early).
  absl::Cleanup remove = [&] {
    shm_unlink(tiny.c_str());
    unlink(link.c_str());
    rmdir(dir.c_str());
  };
  ASSERT_EQ(symlink(("/dev/shm" + trainer.OpenRequest().shm_name()).c_str(),
                    link.c_str()),
            0);
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  const int fd = shm_open(tiny.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 100), 0);
  struct Case {
    std::string name;
    absl::StatusCode code;
    const char* says;
  } cases[] = {
      {"/" + base + "-link", absl::StatusCode::kInvalidArgument,
       "symbolic link"},
      {"/" + base + "-dir", absl::StatusCode::kFailedPrecondition,
       "not a regular"},
      {tiny, absl::StatusCode::kInvalidArgument, "no whole header"},
  };
  for (const Case& c : cases) {
    v1::OpenStepChannelRequest request;
    request.set_shm_name(c.name);
    const absl::Status refused = channels.Open(request).status();
    EXPECT_EQ(refused.code(), c.code) << c.name << ": " << refused;
    EXPECT_THAT(refused.message(), HasSubstr(c.says));
  }
  close(fd);
  EXPECT_EQ(channels.open_channels(), 0);
}

TEST(StepChannelTest, OpenCountIsReportedAsItChanges) {
  std::vector<int> reported;
  absl::Mutex mu;
  StepChannelOptions options = FastOptions();
  options.open_changed = [&](int open) {
    absl::MutexLock lock(&mu);
    reported.push_back(open);
  };
  StepChannels channels(EchoHandler, options);
  Trainer a, b;
  ASSERT_TRUE(channels.Open(a.OpenRequest()).ok());
  ASSERT_TRUE(channels.Open(b.OpenRequest()).ok());
  a.Send("", sc::kOpClose);
  ASSERT_TRUE(EventuallyOpen(channels, 1));
  b.Vanish();
  ASSERT_TRUE(EventuallyOpen(channels, 0));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(reported, (std::vector<int>{1, 2, 1, 0}));
}

TEST(StepChannelTest, ChannelNeedsItsTrainersLockAndOneDaemon) {
  StepChannels channels(EchoHandler, FastOptions());
  StepChannels other_daemon(EchoHandler, FastOptions());
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  absl::StatusOr<v1::OpenStepChannelResponse> again =
      other_daemon.Open(trainer.OpenRequest());
  EXPECT_TRUE(absl::IsFailedPrecondition(again.status()));
  EXPECT_THAT(again.status().message(), HasSubstr("open in a daemon already"));

  Trainer unlocked;
  struct flock unlock = {};
  unlock.l_type = F_UNLCK;
  unlock.l_whence = SEEK_SET;
  unlock.l_start = sc::kTrainerLockByte;
  unlock.l_len = 1;
  ASSERT_EQ(fcntl(unlocked.fd(), F_OFD_SETLK, &unlock), 0);
  absl::StatusOr<v1::OpenStepChannelResponse> no_lock =
      channels.Open(unlocked.OpenRequest());
  EXPECT_TRUE(absl::IsFailedPrecondition(no_lock.status()));
  EXPECT_THAT(no_lock.status().message(), HasSubstr("trainer lock"));
}

TEST(StepChannelTest, LimitCountsOpenChannelsAndCloseFreesOne) {
  StepChannels channels(EchoHandler, FastOptions(/*max_channels=*/2));
  Trainer a, b, c;
  ASSERT_TRUE(channels.Open(a.OpenRequest()).ok());
  ASSERT_TRUE(channels.Open(b.OpenRequest()).ok());
  absl::StatusOr<v1::OpenStepChannelResponse> third =
      channels.Open(c.OpenRequest());
  EXPECT_TRUE(absl::IsResourceExhausted(third.status()));
  EXPECT_THAT(third.status().message(), HasSubstr("--max_step_channels"));
  a.Send("", sc::kOpClose);
  ASSERT_TRUE(EventuallyOpen(channels, 1));
  EXPECT_TRUE(channels.Open(c.OpenRequest()).ok());

  StepChannels off(EchoHandler, FastOptions(/*max_channels=*/0));
  Trainer d;
  EXPECT_TRUE(absl::IsFailedPrecondition(off.Open(d.OpenRequest()).status()));
}

// A trainer replacing its channel at the limit (a new registration) closes
// the old one and opens the new one at once: the open waits for the old
// one's thread to end instead of refusing because it still runs.
TEST(StepChannelTest, ReplacingAChannelAtTheLimitTakesItsSlot) {
  StepChannelOptions options = FastOptions(/*max_channels=*/1);
  options.idle_check = absl::Seconds(5);  // only the close op ends it
  options.slot_wait = absl::Seconds(10);
  StepChannels channels(EchoHandler, options);
  for (int round = 0; round < 20; ++round) {
    Trainer old, replacement;
    ASSERT_TRUE(channels.Open(old.OpenRequest()).ok());
    old.Send("", sc::kOpClose);
    const absl::StatusOr<v1::OpenStepChannelResponse> opened =
        channels.Open(replacement.OpenRequest());
    ASSERT_TRUE(opened.ok()) << "round " << round << ": " << opened.status();
    replacement.Send("", sc::kOpClose);
    ASSERT_TRUE(EventuallyOpen(channels, 0));
  }
}

TEST(StepChannelTest, VanishedTrainerEndsItsChannel) {
  StepChannels channels(EchoHandler, FastOptions());
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  ASSERT_TRUE(EventuallyOpen(channels, 1));
  trainer.Vanish();
  EXPECT_TRUE(EventuallyOpen(channels, 0));
}

TEST(StepChannelTest, ShrunkObjectNeverCrashesTheDaemon) {
  StepChannels channels(EchoHandler, FastOptions());
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  // Only the header page left: the request area reads short.
  ASSERT_EQ(ftruncate(trainer.fd(), 4096), 0);
  ASSERT_TRUE(trainer.Await(trainer.Send("", sc::kOpStep, 100)));
  EXPECT_THAT(trainer.Refusal().message(), HasSubstr("not a muond.v1"));
  // Nothing left: the daemon's reads fail and the channel ends.
  ASSERT_EQ(ftruncate(trainer.fd(), 0), 0);
  EXPECT_TRUE(EventuallyOpen(channels, 0));
  Trainer next;
  ASSERT_TRUE(channels.Open(next.OpenRequest()).ok());
  ASSERT_TRUE(next.Await(next.Send(StepBytes(3))));
  EXPECT_EQ(next.Response().step_id(), 3);
}

TEST(StepChannelTest, ShutdownEndsIdleChannelsAndRefusesNewOnes) {
  auto channels =
      std::make_unique<StepChannels>(EchoHandler, FastOptions(/*max=*/4));
  Trainer a, b;
  ASSERT_TRUE(channels->Open(a.OpenRequest()).ok());
  channels->Shutdown();
  EXPECT_TRUE(EventuallyOpen(*channels, 0));
  EXPECT_TRUE(
      absl::IsFailedPrecondition(channels->Open(b.OpenRequest()).status()));
  channels.reset();  // joins
}

TEST(StepChannelTest, RequestPostedAsTheDaemonStopsIsAnswered) {
  absl::Notification entered, release;
  auto handler = [&](const v1::StepRequest& request, const TrainerVerdict&) {
    if (request.step_id() == 1) {
      entered.Notify();
      release.WaitForNotification();
    }
    return EchoHandler(request);
  };
  StepChannels channels(handler, FastOptions());
  Trainer trainer;
  ASSERT_TRUE(channels.Open(trainer.OpenRequest()).ok());
  const uint32_t one = trainer.Send(StepBytes(1));
  entered.WaitForNotification();
  channels.Shutdown();  // step 1 in flight; step 2 posted after the stop
  const uint32_t two = trainer.Send(StepBytes(2));
  release.Notify();
  ASSERT_TRUE(trainer.Await(two));
  EXPECT_GT(two, one);
  EXPECT_EQ(trainer.Response().step_id(), 2);
  EXPECT_TRUE(EventuallyOpen(channels, 0));  // and no more after it
}

TEST(StepChannelTest, RefusedThreadLeavesNoChannelBehind) {
  // The system refuses the channel's thread (a pids or thread limit):
  // std::thread throws. The open is refused by name, and nothing stays: no
  // slot, no descriptor or lock on the trainer's object, and the daemon
  // exits cleanly (no join of a thread never started).
  StepChannelOptions options = FastOptions(/*max_channels=*/1);
  bool refuse = true;
  options.start_thread = [&refuse](std::function<void()> body) {
    if (refuse) {
      throw std::system_error(EAGAIN, std::generic_category(),
                              "Resource temporarily unavailable");
    }
    return std::thread(std::move(body));
  };
  auto channels = std::make_unique<StepChannels>(EchoHandler, options);
  Trainer trainer;
  absl::StatusOr<v1::OpenStepChannelResponse> refused =
      channels->Open(trainer.OpenRequest());
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status()));
  EXPECT_THAT(refused.status().message(), HasSubstr("cannot start a thread"));
  EXPECT_THAT(refused.status().message(), HasSubstr("shm_name"));
  EXPECT_EQ(channels->open_channels(), 0);
  struct flock daemon_lock = {};
  daemon_lock.l_type = F_WRLCK;
  daemon_lock.l_whence = SEEK_SET;
  daemon_lock.l_start = sc::kDaemonLockByte;
  daemon_lock.l_len = 1;
  ASSERT_EQ(fcntl(trainer.fd(), F_OFD_GETLK, &daemon_lock), 0);
  EXPECT_EQ(daemon_lock.l_type, F_UNLCK);  // the daemon's descriptor is gone
  refuse = false;  // its slot is free: the one channel allowed opens
  ASSERT_TRUE(channels->Open(trainer.OpenRequest()).ok());
  ASSERT_TRUE(trainer.Await(trainer.Send(StepBytes(5))));
  EXPECT_EQ(trainer.Response().step_id(), 5);
  channels.reset();  // joins; aborted here before
}

// A step sent before its trainer's checks is answered only after the
// trainer's verdict for that request: go answers it as any step; withdraw,
// an unknown verdict, a verdict for an earlier request, no verdict in time
// and a trainer that ends are each the handler's refusal, said by name.
// Each with a daemon that sleeps till the verdict and with one that polls
// for it first (request_poll, as a GPU daemon; 200 ms asked, 100 ms the
// most that counts), within which most of these verdicts come.
class VerdictTest : public ::testing::TestWithParam<absl::Duration> {
 protected:
  VerdictTest() {
    StepChannelOptions options = FastOptions();
    options.verdict_timeout = absl::Milliseconds(300);
    options.request_poll = GetParam();
    channels_ = std::make_unique<StepChannels>(
        [this](const v1::StepRequest& request, const TrainerVerdict& verdict) {
          absl::StatusOr<v1::StepResponse> answer =
              EchoHandler(request, verdict);
          absl::MutexLock lock(&mu_);
          said_.push_back(answer.status());
          return answer;
        },
        options);
    absl::StatusOr<v1::OpenStepChannelResponse> opened =
        channels_->Open(trainer_.OpenRequest());
    EXPECT_TRUE(opened.ok()) << opened.status();
    EXPECT_TRUE(opened.ok() && opened->trainer_verdicts());
  }
  // The handler's outcomes so far, once there are `n` (or after 10 s).
  std::vector<absl::Status> Said(size_t n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (true) {
      {
        absl::MutexLock lock(&mu_);
        if (said_.size() >= n || absl::Now() > deadline) return said_;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  Trainer trainer_;
  absl::Mutex mu_;
  std::vector<absl::Status> said_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<StepChannels> channels_;
};

TEST_P(VerdictTest, GoAnswersTheStepOnlyAfterTheVerdict) {
  const uint32_t seq = trainer_.Send(StepBytes(7, /*await_verdict=*/true));
  EXPECT_FALSE(trainer_.Await(seq, absl::Milliseconds(100)));
  trainer_.Verdict(seq, sc::kVerdictGo);
  ASSERT_TRUE(trainer_.Await(seq));
  EXPECT_EQ(trainer_.Response().step_id(), 7);
  // A step without the field never waits for one.
  ASSERT_TRUE(trainer_.Await(trainer_.Send(StepBytes(8))));
  EXPECT_EQ(trainer_.Response().step_id(), 8);
}

TEST_P(VerdictTest, WithdrawAndUnknownVerdictsAreRefusedByName) {
  uint32_t seq = trainer_.Send(StepBytes(7, true));
  trainer_.Verdict(seq, sc::kVerdictWithdraw);
  ASSERT_TRUE(trainer_.Await(seq));
  EXPECT_EQ(trainer_.Refusal().code(), int(absl::StatusCode::kAborted));
  EXPECT_THAT(trainer_.Refusal().message(),
              HasSubstr("its trainer withdrew it"));
  seq = trainer_.Send(StepBytes(7, true));
  trainer_.Verdict(seq, 9);
  ASSERT_TRUE(trainer_.Await(seq));
  EXPECT_EQ(trainer_.Refusal().code(), int(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(trainer_.Refusal().message(),
              HasSubstr("verdict 9 is neither go (1) nor withdraw (2)"));
}

TEST_P(VerdictTest, AnEarlierRequestsVerdictIsNotThisOnes) {
  const uint32_t first = trainer_.Send(StepBytes(7, true));
  trainer_.Verdict(first, sc::kVerdictGo);
  ASSERT_TRUE(trainer_.Await(first));
  // The go of the last request stays in the header: not this request's.
  const uint32_t second = trainer_.Send(StepBytes(8, true));
  ASSERT_TRUE(trainer_.Await(second));
  EXPECT_EQ(trainer_.Refusal().code(),
            int(absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(trainer_.Refusal().message(), HasSubstr("no verdict came"));
}

TEST_P(VerdictTest, ATrainerThatEndsBeforeItsVerdictWithdraws) {
  trainer_.Send(StepBytes(7, true));
  trainer_.Vanish();
  const std::vector<absl::Status> said = Said(1);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_TRUE(absl::IsAborted(said[0])) << said[0];
  EXPECT_THAT(said[0].message(), HasSubstr("trainer ended before its verdict"));
}

// An hour of poll counts as RequestPoll::kMaxPoll (100 ms): a trainer gone
// before its verdict is still seen as gone, not as a timeout.
INSTANTIATE_TEST_SUITE_P(SleepingAndPolling, VerdictTest,
                         ::testing::Values(absl::ZeroDuration(),
                                           absl::Milliseconds(200),
                                           absl::Hours(1)));

}  // namespace
}  // namespace muond
