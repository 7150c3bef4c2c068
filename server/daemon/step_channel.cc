#include "server/daemon/step_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/common/echo.h"
#include "core/common/status_macros.h"
#include "glog/logging.h"
#include "proto/status_details.h"
#include "proto/step_channel_layout.h"
#include "server/daemon/request_poll.h"

namespace muond {
namespace sc = step_channel;

namespace {

constexpr uint64_t kPageBytes = 4096;
// What StepTimings.received_at_us and answered_at_us add to an answer at
// most: a tag byte and a 10-byte varint each, and up to 2 bytes of the
// timings' own tag and length.
constexpr uint64_t kMaxStampBytes = 24;

// CLOCK_MONOTONIC in microseconds: the clock the trainer's time.monotonic()
// reads on the same host (StepTimings.received_at_us, answered_at_us).
int64_t MonotonicMicros() {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return int64_t(now.tv_sec) * 1000000 + now.tv_nsec / 1000;
}

long Futex(const void* word, int op, uint32_t value,
           const struct timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

bool ReadBytes(int fd, uint64_t offset, void* out, size_t n) {
  char* dst = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = pread(fd, dst, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;  // an error, or the object shrank
    dst += got, offset += got, n -= got;
  }
  return true;
}

bool WriteBytes(int fd, uint64_t offset, const void* data, size_t n) {
  const char* src = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t put = pwrite(fd, src, n, static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    src += put, offset += put, n -= put;
  }
  return true;
}

template <typename T>
bool Read(int fd, uint64_t offset, T* value) {
  return ReadBytes(fd, offset, value, sizeof *value);
}

template <typename T>
bool Write(int fd, uint64_t offset, T value) {
  return WriteBytes(fd, offset, &value, sizeof value);
}

// The trainer's request_seq. pread's copy is not one 32-bit load, so a read
// racing the trainer's store could see half of each value: read until two
// reads agree (the trainer stores it once a step).
bool ReadSeq(int fd, uint32_t* seq) {
  uint32_t again = 0;
  if (!Read(fd, sc::kRequestSeqOffset, seq)) return false;
  while (Read(fd, sc::kRequestSeqOffset, &again)) {
    if (again == *seq) return true;
    *seq = again;
  }
  return false;
}

absl::Status HeaderError(const std::string& name, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("shm_name: step channel '", Echo(name), "' ", what,
                   " (proto/step_channel_layout.h)"));
}

absl::Status CheckCapacity(const std::string& name, const char* field,
                           uint32_t capacity) {
  if (capacity % kPageBytes == 0 && capacity >= sc::kMinCapacity &&
      capacity <= sc::kMaxCapacity) {
    return absl::OkStatus();
  }
  return HeaderError(
      name, absl::StrCat("has ", field, " ", capacity,
                         "; it must be a multiple of ", kPageBytes, " in [",
                         sc::kMinCapacity, ", ", sc::kMaxCapacity, "]"));
}

}  // namespace

// The daemon's end of one channel.
struct StepChannelEnd {
  std::string name;
  int fd = -1;
  // The header page, mapped only as the futex calls' address.
  void* header = MAP_FAILED;
  uint32_t request_capacity = 0;
  uint32_t response_capacity = 0;
  uint32_t last_seq = 0;
  // The last answer too large for the response area and its request
  // (serialized), for TakeKeptAnswer; guarded by StepChannels::mu_.
  std::string kept_request;
  std::optional<absl::StatusOr<v1::StepResponse>> kept_answer;
  std::thread thread;
  std::atomic<bool> done{false};

  const uint32_t* word(uint64_t offset) const {
    return reinterpret_cast<const uint32_t*>(static_cast<const char*>(header) +
                                             offset);
  }
  // Drops the daemon's lock (with the last reference to the description).
  void Release() {
    if (header != MAP_FAILED) munmap(header, kPageBytes);
    if (fd >= 0) close(fd);
    header = MAP_FAILED;
    fd = -1;
  }
  ~StepChannelEnd() { Release(); }
};

StepChannels::StepChannels(StepHandler handler, StepChannelOptions options)
    : handler_(std::move(handler)), options_(options) {
  opener_.set_allow_foreign_shm(options_.allow_foreign_shm);
}

StepChannels::~StepChannels() {
  Shutdown();
  std::list<std::unique_ptr<StepChannelEnd>> channels;
  {
    absl::MutexLock lock(&mu_);
    channels.swap(channels_);
  }
  for (auto& channel : channels) channel->thread.join();
}

void StepChannels::Shutdown() {
  stopping_.store(true);
  absl::MutexLock lock(&mu_);
  for (auto& channel : channels_) {
    if (channel->header == MAP_FAILED) continue;  // ended already
    Futex(channel->word(sc::kRequestSeqOffset), FUTEX_WAKE, 1, nullptr);
  }
}

int StepChannels::OpenCount() const {
  int open = 0;
  for (const auto& channel : channels_) open += !channel->done.load();
  return open;
}

int StepChannels::open_channels() const {
  absl::MutexLock lock(&mu_);
  return OpenCount();
}

void StepChannels::ReapFinished() {
  for (auto it = channels_.begin(); it != channels_.end();) {
    if (!(*it)->done.load()) {
      ++it;
      continue;
    }
    (*it)->thread.join();
    it = channels_.erase(it);
  }
}

bool StepChannels::AnyEnded() const {
  if (stopping_.load()) return true;
  for (const auto& channel : channels_) {
    if (channel->done.load()) return true;
  }
  return false;
}

absl::Status StepChannels::SlotFree() {
  ReapFinished();
  if (static_cast<int>(channels_.size()) < options_.max_channels) {
    return absl::OkStatus();
  }
  // A channel closed just before this open (its trainer's replacement of
  // it) ends within moments: its slot is this open's. A channel's thread
  // sets `done` under mu_, which wakes this wait.
  if (options_.max_channels > 0 &&
      mu_.AwaitWithTimeout(absl::Condition(this, &StepChannels::AnyEnded),
                           options_.slot_wait)) {
    ReapFinished();
    if (static_cast<int>(channels_.size()) < options_.max_channels) {
      return absl::OkStatus();
    }
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "this daemon has ", channels_.size(),
      " step channels open, its --max_step_channels: close one (an "
      "optimizer's close()) or send steps with the Step RPC"));
}

absl::Status StepChannels::CheckRoom() {
  if (options_.max_channels <= 0) {
    return absl::FailedPreconditionError(
        "step channels are off on this daemon (muond-daemon "
        "--max_step_channels=0): send steps with the Step RPC");
  }
  if (stopping_.load()) {
    return absl::FailedPreconditionError(
        "the daemon is shutting down: no new step channel");
  }
  absl::MutexLock lock(&mu_);
  return SlotFree();
}

namespace {

// The header's fields into `channel`, each checked against its rule; `size`:
// the object's bytes.
absl::Status ReadHeader(StepChannelEnd& channel, uint64_t size) {
  const std::string& name = channel.name;
  const int fd = channel.fd;
  if (size < sc::kRequestOffset) {
    return HeaderError(name,
                       absl::StrCat("has ", size, " bytes, no whole header (",
                                    sc::kRequestOffset, " bytes)"));
  }
  uint64_t magic = 0;
  uint32_t version = 0;
  if (!Read(fd, sc::kMagicOffset, &magic) ||
      !Read(fd, sc::kVersionOffset, &version) ||
      !Read(fd, sc::kRequestCapacityOffset, &channel.request_capacity) ||
      !Read(fd, sc::kResponseCapacityOffset, &channel.response_capacity) ||
      !Read(fd, sc::kRequestSeqOffset, &channel.last_seq)) {
    return HeaderError(name, absl::StrCat("cannot be read: ", strerror(errno)));
  }
  if (magic != sc::kMagic) {
    return HeaderError(name, "does not start with the channel's magic");
  }
  if (version != sc::kVersion) {
    return HeaderError(
        name, absl::StrCat("is layout version ", version,
                           "; this daemon speaks version ", sc::kVersion));
  }
  for (auto [field, capacity] :
       {std::pair{"request_capacity", channel.request_capacity},
        std::pair{"response_capacity", channel.response_capacity}}) {
    RETURN_IF_ERROR(CheckCapacity(name, field, capacity));
  }
  const uint64_t needed =
      sc::ResponseOffset(channel.request_capacity) + channel.response_capacity;
  if (size < needed) {
    return HeaderError(
        name,
        absl::StrCat("has ", size, " bytes; its capacities need ", needed));
  }
  return absl::OkStatus();
}

// The trainer's lock is held (so its end can be seen), the daemon's taken
// (one daemon per channel), the header page mapped for the futex calls.
absl::Status LockAndMap(StepChannelEnd& channel) {
  const std::string& name = channel.name;
  if (!sc::LockHeldByOther(channel.fd, sc::kTrainerLockByte)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm_name: no process holds the trainer lock of step channel '",
        Echo(name), "' (an F_OFD_SETLK write lock on byte ",
        sc::kTrainerLockByte, "): the daemon could not tell when it ends"));
  }
  struct flock mine = sc::OneByte(F_WRLCK, sc::kDaemonLockByte);
  if (fcntl(channel.fd, F_OFD_SETLK, &mine) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shm_name: step channel '", Echo(name),
        "' is open in a daemon already (its daemon lock byte is held)"));
  }
  channel.header =
      mmap(nullptr, kPageBytes, PROT_READ, MAP_SHARED, channel.fd, 0);
  if (channel.header == MAP_FAILED) {
    return absl::UnavailableError(
        absl::StrCat("shm_name: cannot map step channel '", Echo(name),
                     "': ", strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StepChannels::StartServing(
    std::unique_ptr<StepChannelEnd> channel) {
  absl::MutexLock lock(&mu_);
  if (stopping_.load()) {
    return absl::FailedPreconditionError(
        "the daemon is shutting down: no new step channel");
  }
  // Again under the lock: opens racing past CheckRoom stop at the limit.
  RETURN_IF_ERROR(SlotFree());
  StepChannelEnd* raw = channel.get();
  // The thread before the list entry: a refused thread (std::thread throws;
  // gRPC would answer UNKNOWN) must leave no entry without a thread, which
  // would hold its slot, descriptor and lock for good and abort the daemon
  // at exit (joining a thread never started). A thread that ends at once
  // waits for mu_, held here until the entry is in.
  try {
    std::function<void()> serve = [this, raw] {
      // Named apart from the gRPC thread that started it (Linux copies
      // the creator's name): "muond-channel" in top, perf and gdb.
      pthread_setname_np(pthread_self(), "muond-channel");
      Serve(raw);
    };
    raw->thread = options_.start_thread
                      ? options_.start_thread(std::move(serve))
                      : std::thread(std::move(serve));
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shm_name: cannot start a thread for step channel '", Echo(raw->name),
        "': ", e.what(),
        " (a pids or thread limit): send steps with the Step RPC, or raise "
        "the limit"));
  }
  channels_.push_back(std::move(channel));
  CountChanged();
  return absl::OkStatus();
}

void StepChannels::CountChanged() {
  if (options_.open_changed) options_.open_changed(OpenCount());
}

absl::StatusOr<v1::OpenStepChannelResponse> StepChannels::Open(
    const v1::OpenStepChannelRequest& request) {
  RETURN_IF_ERROR(CheckRoom());
  auto channel = std::make_unique<StepChannelEnd>();
  channel->name = request.shm_name();
  struct stat st;
  // Any non-empty object: ReadHeader says what a short one lacks.
  ASSIGN_OR_RETURN(channel->fd,
                   opener_.OpenShmFile(channel->name, 1, "shm_name", &st));
  RETURN_IF_ERROR(ReadHeader(*channel, static_cast<uint64_t>(st.st_size)));
  RETURN_IF_ERROR(LockAndMap(*channel));
  const std::string name = channel->name;
  RETURN_IF_ERROR(StartServing(std::move(channel)));
  LOG(INFO) << "step channel '" << Echo(name) << "' open";
  v1::OpenStepChannelResponse response;
  response.set_version(sc::kVersion);
  response.set_answers_kept(true);
  response.set_trainer_verdicts(true);
  return response;
}

void StepChannels::Keep(
    StepChannelEnd* channel, std::string request,
    std::optional<absl::StatusOr<v1::StepResponse>> answer) {
  absl::MutexLock lock(&mu_);
  channel->kept_request = std::move(request);
  channel->kept_answer = std::move(answer);
}

std::optional<absl::StatusOr<v1::StepResponse>> StepChannels::TakeKeptAnswer(
    const v1::StepRequest& request) {
  absl::MutexLock lock(&mu_);
  std::optional<std::string> bytes;
  for (auto& channel : channels_) {
    if (!channel->kept_answer.has_value()) continue;
    if (!bytes) bytes = request.SerializeAsString();
    if (channel->kept_request != *bytes) continue;
    std::optional<absl::StatusOr<v1::StepResponse>> answer;
    answer.swap(channel->kept_answer);
    channel->kept_request.clear();
    return answer;
  }
  return std::nullopt;
}

namespace {

// The request in the channel's request area, or the refusal naming the
// field and the rule.
absl::StatusOr<v1::StepRequest> ReadRequest(int fd, uint32_t op, uint32_t len,
                                            uint32_t capacity) {
  if (op != sc::kOpStep) {
    return absl::InvalidArgumentError(
        absl::StrCat("step channel: request_op ", op, " is neither ",
                     sc::kOpStep, " (step) nor ", sc::kOpClose, " (close)"));
  }
  if (len > capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("step channel: request_len ", len,
                     " exceeds the channel's request_capacity ", capacity));
  }
  std::string bytes(len, '\0');
  v1::StepRequest request;
  if (!ReadBytes(fd, sc::kRequestOffset, bytes.data(), len) ||
      !request.ParseFromString(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("step channel: the request's ", len,
                     " bytes are not a muond.v1.StepRequest"));
  }
  return request;
}

}  // namespace

absl::Status StepChannels::AwaitVerdict(StepChannelEnd* channel, uint32_t seq) {
  const int fd = channel->fd;
  const absl::Time deadline = absl::Now() + options_.verdict_timeout;
  const struct timespec slice =
      absl::ToTimespec(std::min(options_.idle_check, options_.verdict_timeout));
  // A polling daemon looks for the verdict without sleeping for as long as
  // it polls for a request: the trainer's checks mostly end within it, and
  // waking for a verdict would land on the step as a request's wake-up does.
  const RequestPoll::Clock::time_point poll_until =
      RequestPoll::Clock::now() +
      RequestPoll::Capped(absl::ToChronoNanoseconds(options_.request_poll));
  while (true) {
    uint32_t said = 0, verdict = 0;
    if (!Read(fd, sc::kVerdictSeqOffset, &said)) {
      return absl::AbortedError("the step channel's object shrank");
    }
    if (said == seq) {
      // The trainer wrote the verdict before its sequence number.
      std::atomic_thread_fence(std::memory_order_acquire);
      if (!Read(fd, sc::kVerdictOffset, &verdict)) {
        return absl::AbortedError("the step channel's object shrank");
      }
      if (verdict == sc::kVerdictGo) return absl::OkStatus();
      if (verdict == sc::kVerdictWithdraw) {
        return absl::AbortedError("its trainer withdrew it");
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "its trainer's verdict ", verdict, " is neither go (", sc::kVerdictGo,
          ") nor withdraw (", sc::kVerdictWithdraw, ")"));
    }
    if (stopping_.load()) {
      return absl::AbortedError("the daemon is shutting down");
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no verdict came from its trainer within ",
                       absl::FormatDuration(options_.verdict_timeout)));
    }
    if (RequestPoll::Clock::now() < poll_until) {
      sched_yield();
      continue;
    }
    if (Futex(channel->word(sc::kVerdictSeqOffset), FUTEX_WAIT, said, &slice) !=
            0 &&
        errno == ETIMEDOUT && !sc::LockHeldByOther(fd, sc::kTrainerLockByte)) {
      return absl::AbortedError("its trainer ended before its verdict");
    }
  }
}

namespace {

// Reads request_seq until it moves past `last` (true), `until` passes, the
// daemon stops or the object can no longer be read, yielding the core
// between looks (sched_yield returns at once when nothing else waits for it).
bool PollForRequest(int fd, uint32_t last, RequestPoll::Clock::time_point until,
                    const std::atomic<bool>& stopping) {
  uint32_t seq = last;
  while (ReadSeq(fd, &seq) && seq == last && !stopping.load() &&
         RequestPoll::Clock::now() < until) {
    sched_yield();
  }
  return seq != last;
}

}  // namespace

bool StepChannels::AwaitRequest(StepChannelEnd* channel, RequestPoll& poll) {
  absl::Duration slice = options_.idle_check;
  if (const std::optional<RequestPoll::Window> window = poll.Next()) {
    const RequestPoll::Clock::time_point now = RequestPoll::Clock::now();
    if (now >= window->from) {
      if (PollForRequest(channel->fd, channel->last_seq, window->until,
                         stopping_)) {
        requests_polled_.fetch_add(1);
      }
      poll.Spent();  // a request that came is taken next: Arrived resets it
      return true;
    }
    slice = std::min(slice, absl::FromChrono(window->from - now));
  }
  const struct timespec wait = absl::ToTimespec(slice);
  // A timeout is a moment to look at the trainer's lock (the window's too).
  return !(Futex(channel->word(sc::kRequestSeqOffset), FUTEX_WAIT,
                 channel->last_seq, &wait) != 0 &&
           errno == ETIMEDOUT &&
           !sc::LockHeldByOther(channel->fd, sc::kTrainerLockByte));
}

void StepChannels::Serve(StepChannelEnd* channel) {
  const int fd = channel->fd;
  RequestPoll poll(absl::ToChronoNanoseconds(options_.request_poll));
  std::string ended = "closed by the trainer";
  // A request posted before the shutdown is still answered (the handler
  // refuses it once the table is shut down), one at most: a trainer bumping
  // request_seq must not hold the daemon's exit.
  bool answered_since_stopping = false;
  while (true) {
    uint32_t seq = 0;
    if (!ReadSeq(fd, &seq)) {
      ended = "the object shrank";
      break;
    }
    if (stopping_.load() &&
        (seq == channel->last_seq || answered_since_stopping)) {
      ended = "the daemon is shutting down";
      break;
    }
    answered_since_stopping = stopping_.load();
    if (seq == channel->last_seq) {
      if (!AwaitRequest(channel, poll)) {
        ended = "its trainer is gone";
        break;
      }
      continue;
    }
    channel->last_seq = seq;
    poll.Arrived(RequestPoll::Clock::now());
    // The trainer wrote the request before its sequence number.
    std::atomic_thread_fence(std::memory_order_acquire);
    uint32_t op = 0, len = 0;
    if (!Read(fd, sc::kRequestOpOffset, &op) ||
        !Read(fd, sc::kRequestLenOffset, &len)) {
      ended = "the object shrank";
      break;
    }
    if (op == sc::kOpClose) break;
    absl::StatusOr<v1::StepRequest> request =
        ReadRequest(fd, op, len, channel->request_capacity);
    const int64_t received_at = MonotonicMicros();  // read and parsed
    Keep(channel, "", std::nullopt);  // a new request: the last one fetched
    const TrainerVerdict verdict = [this, channel, seq] {
      return AwaitVerdict(channel, seq);
    };
    absl::StatusOr<v1::StepResponse> answer =
        request.ok() ? handler_(*request, verdict)
                     : absl::StatusOr<v1::StepResponse>(request.status());
    std::string bytes;
    uint32_t kind = sc::kStepResponse;
    if (answer.ok()) {
      // Stamped only where it fits the channel: an answer fetched over the
      // Step RPC carries none (StepTimings.received_at_us).
      if (answer->ByteSizeLong() + kMaxStampBytes <=
          channel->response_capacity) {
        answer->mutable_timings()->set_received_at_us(received_at);
        answer->mutable_timings()->set_answered_at_us(MonotonicMicros());
      }
      answer->SerializeToString(&bytes);
    } else {
      bytes = ToRpcStatusBytes(answer.status());  // as over gRPC
      kind = sc::kRpcStatus;
    }
    const uint32_t size = static_cast<uint32_t>(bytes.size());
    if (bytes.size() > channel->response_capacity) {
      kind = sc::kTooLarge;
      // Before the answer is published: the trainer's Step RPC for it may
      // come at once.
      if (request.ok()) {
        Keep(channel, request->SerializeAsString(), std::move(answer));
      }
    }
    const bool written =
        (kind == sc::kTooLarge ||
         WriteBytes(fd, sc::ResponseOffset(channel->request_capacity),
                    bytes.data(), bytes.size())) &&
        Write(fd, sc::kResponseLenOffset, size) &&
        Write(fd, sc::kResponseKindOffset, kind);
    // The answer before its sequence number.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!written || !Write(fd, sc::kResponseSeqOffset, seq)) {
      ended = "the object shrank";
      break;
    }
    // As the trainer can see it: before the wake-up, which a woken trainer
    // may preempt.
    poll.Answered(RequestPoll::Clock::now());
    Futex(channel->word(sc::kResponseSeqOffset), FUTEX_WAKE, INT32_MAX,
          nullptr);
  }
  LOG(INFO) << "step channel '" << Echo(channel->name) << "' ended: " << ended;
  // Now, not at the reaping: the daemon's lock lives until both the mapping
  // and the descriptor are gone, and the trainer reads its release as "the
  // channel is closed".
  absl::MutexLock lock(&mu_);
  channel->Release();
  channel->done.store(true);
  CountChanged();
}

}  // namespace muond
