#include "client/cpp/step_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "proto/status_details.h"
#include "proto/step_channel_layout.h"

namespace muond {
namespace sc = step_channel;

namespace {

constexpr uint32_t kPageBytes = 4096;
// How often a waiting trainer checks that its daemon still lives: a daemon
// that died mid-step is noticed within this, not at the RPC deadline.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(500);

// Shared futexes (no FUTEX_PRIVATE_FLAG): the daemon waits on the same words
// through its own mapping.
long Futex(uint32_t* word, int op, uint32_t value,
           const struct timespec* timeout) {
  return syscall(SYS_futex, word, op, value, timeout, nullptr, 0);
}

uint32_t WholePages(uint64_t bytes) {
  const uint64_t pages = (bytes + kPageBytes - 1) / kPageBytes * kPageBytes;
  return static_cast<uint32_t>(std::min<uint64_t>(
      sc::kMaxCapacity, std::max<uint64_t>(sc::kMinCapacity, pages)));
}

uint64_t RandomBits() {
  uint64_t bits = 0;
  char* out = reinterpret_cast<char*>(&bits);
  size_t got = 0;
  while (got < sizeof bits) {
    const ssize_t n = getrandom(out + got, sizeof bits - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return bits;
}

// The 8 hex digits that follow the pid: processes of other PID namespaces
// sharing /dev/shm have the same small pids.
const std::string& ProcessTag() {
  static const std::string* tag = new std::string(
      absl::StrCat(absl::Hex(RandomBits() & 0xFFFFFFFFu, absl::kZeroPad8)));
  return *tag;
}

absl::Status ShmError(const char* what, const std::string& name, int error) {
  const std::string text = absl::StrCat(what, " step channel shm object '",
                                        name, "': ", strerror(error));
  if (error == EEXIST) return absl::AlreadyExistsError(text);
  return absl::UnavailableError(text);
}

StepChannel::Reply Failed(absl::Status status) {
  return {StepChannel::Outcome::kFailed, std::move(status)};
}

// The channels open in this process, for the fork handler.
std::mutex& TrackedMutex() {
  static auto* mu = new std::mutex;
  return *mu;
}

std::set<StepChannel*>& Tracked() {
  static auto* channels = new std::set<StepChannel*>;
  return *channels;
}

}  // namespace

StepChannelCapacities StepChannelCapacitiesFor(
    const std::vector<v1::ParamGroup>& groups, size_t refusal_bytes) {
  uint64_t names = 0, overrides = 0, prefixes = 0;
  for (const v1::ParamGroup& group : groups) {
    overrides += group.name().size() + 64;
    // An answer names a skipped param "group/param" (skipped_nonfinite).
    prefixes += (group.name().size() + 1) * uint64_t(group.params_size());
    for (const v1::Param& param : group.params()) {
      names += param.name().size() + 16;
    }
  }
  constexpr uint64_t kSlack = 64 << 10;
  return {.request = WholePages(kSlack + names + overrides + refusal_bytes),
          .response = WholePages(kSlack + names + prefixes)};
}

absl::Status CheckStepChannelCapacity(absl::string_view field,
                                      uint32_t capacity) {
  if (capacity % kPageBytes == 0 && capacity >= sc::kMinCapacity &&
      capacity <= sc::kMaxCapacity) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " ", capacity, " must be a multiple of ", kPageBytes,
                   " in [", sc::kMinCapacity, ", ", sc::kMaxCapacity, "]"));
}

std::string StepChannelShmName(absl::string_view job_id) {
  std::string job(job_id.empty() ? "job" : job_id);
  for (char& c : job) {
    const bool kept = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                      (c >= '0' && c <= '9') || c == '_' || c == '.' ||
                      c == '-';
    if (!kept) c = '_';
  }
  return absl::StrCat("/muond-", job, "-", getpid(), "-", ProcessTag(), "-",
                      RandomBits() >> 1);
}

StepChannel::StepChannel(int fd, StepChannelCapacities capacities)
    : fd_(fd),
      capacities_(capacities),
      size_(sc::ResponseOffset(capacities.request) + capacities.response),
      pid_(getpid()) {}

absl::StatusOr<std::unique_ptr<StepChannel>> StepChannel::Create(
    const std::string& name, StepChannelCapacities capacities) {
  for (auto [field, capacity] :
       {std::pair{"request capacity", capacities.request},
        std::pair{"response capacity", capacities.response}}) {
    if (absl::Status st = CheckStepChannelCapacity(field, capacity); !st.ok()) {
      return st;
    }
  }
  InstallForkHandler();
  std::unique_ptr<StepChannel> channel;
  absl::Status mapped;
  {
    // No fork from the descriptor's creation to its tracking (the fork
    // handler takes this mutex): a child would keep an untracked copy of it,
    // so the trainer's lock, past this process's death.
    std::lock_guard<std::mutex> no_fork(TrackedMutex());
    // Close-on-exec: a child that execs must not keep the trainer's lock.
    const int fd =
        shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return ShmError("cannot create", name, errno);
    channel.reset(new StepChannel(fd, capacities));
    mapped = channel->MapAndLock();
    if (mapped.ok()) Tracked().insert(channel.get());
  }
  if (!mapped.ok()) {
    channel.reset();
    shm_unlink(name.c_str());
    return absl::Status(mapped.code(),
                        absl::StrCat(name, ": ", mapped.message()));
  }
  return channel;
}

absl::Status StepChannel::MapAndLock() {
  if (const int error = posix_fallocate(fd_, 0, static_cast<off_t>(size_));
      error != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot reserve ", size_, " bytes: ", strerror(error)));
  }
  void* base = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(absl::StrCat("mmap: ", strerror(errno)));
  }
  base_ = static_cast<char*>(base);
  const uint64_t magic = sc::kMagic;
  std::memcpy(base_ + sc::kMagicOffset, &magic, sizeof magic);
  *Word(sc::kVersionOffset) = sc::kVersion;
  *Word(sc::kRequestCapacityOffset) = capacities_.request;
  *Word(sc::kResponseCapacityOffset) = capacities_.response;
  struct flock lock = sc::OneByte(F_WRLCK, sc::kTrainerLockByte);
  if (fcntl(fd_, F_OFD_SETLK, &lock) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot take the trainer's lock: ", strerror(errno)));
  }
  return absl::OkStatus();
}

StepChannel::~StepChannel() { Close(); }

uint32_t* StepChannel::Word(uint64_t offset) const {
  return reinterpret_cast<uint32_t*>(base_ + offset);
}

bool StepChannel::usable() const {
  return fd_ >= 0 && !broken_ && !end_gone_ && getpid() == pid_;
}

std::string StepChannel::WhyUnusable() const {
  if (getpid() != pid_ || fd_ < 0) {
    return "it is closed, or this process is a fork of its creator";
  }
  if (broken_) return absl::StrCat("a step's outcome is unknown: ", broken_by_);
  if (end_gone_) return "the daemon's end of it was gone before a step";
  return "";
}

StepChannel::Reply StepChannel::Step(const v1::StepRequest& request,
                                     absl::Time deadline) {
  if (!usable()) return {};
  if (!sc::LockHeldByOther(fd_, sc::kDaemonLockByte)) {
    // The daemon's end is gone (its process, or its thread ended the
    // channel) before anything was written: the step goes over gRPC at once
    // rather than waiting a slice to call it Unavailable.
    end_gone_ = true;
    return {};
  }
  const size_t length = request.ByteSizeLong();
  if (length > capacities_.request) return {};
  request.SerializeWithCachedSizesToArray(
      reinterpret_cast<uint8_t*>(base_ + sc::kRequestOffset));
  broken_ = true;  // until the answer is read
  Post(sc::kOpStep, static_cast<uint32_t>(length));
  Reply reply;
  if (absl::Status waited = AwaitAnswer(deadline); !waited.ok()) {
    reply = Failed(std::move(waited));
  } else {
    reply = ReadAnswer();
  }
  broken_ = reply.outcome == Outcome::kFailed;
  if (broken_) broken_by_ = reply.answer.status().ToString();
  return reply;
}

// The request written, then its sequence number with release ordering (the
// daemon reads the request once it sees the number), then the daemon woken.
void StepChannel::Post(uint32_t op, uint32_t length) {
  std::atomic_ref<uint32_t>(*Word(sc::kRequestLenOffset))
      .store(length, std::memory_order_relaxed);
  std::atomic_ref<uint32_t>(*Word(sc::kRequestOpOffset))
      .store(op, std::memory_order_relaxed);
  ++seq_;
  std::atomic_ref<uint32_t>(*Word(sc::kRequestSeqOffset))
      .store(seq_, std::memory_order_release);
  Futex(Word(sc::kRequestSeqOffset), FUTEX_WAKE, 1, nullptr);
}

absl::Status StepChannel::AwaitAnswer(absl::Time deadline) {
  std::atomic_ref<uint32_t> response_seq(*Word(sc::kResponseSeqOffset));
  const absl::Time start = absl::Now();
  // When to poll instead of sleeping (set_answer_poll), once a step.
  std::optional<absl::Time> poll_from;
  if (answer_poll_ > absl::ZeroDuration() && last_wait_ >= 2 * answer_poll_) {
    poll_from = start + last_wait_ - answer_poll_;
  }
  while (true) {
    const uint32_t seen = response_seq.load(std::memory_order_acquire);
    if (seen == seq_) {
      last_wait_ = absl::Now() - start;
      return absl::OkStatus();
    }
    const absl::Time now = absl::Now();
    const absl::Duration left = deadline - now;
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("Deadline Exceeded");  // as gRPC's
    }
    absl::Duration wait = std::min(left, kWaitSlice);
    if (poll_from.has_value()) {
      if (now >= *poll_from) {
        poll_from.reset();
        ++answer_polls_;
        PollAnswer(
            std::min({now + 2 * answer_poll_, now + kWaitSlice, deadline}));
        // A daemon gone during the poll is seen at its end, as at a slice's.
        if (DaemonGone()) {
          return absl::UnavailableError(
              "its step channel's lock is gone (the daemon's process ended) "
              "before it answered");
        }
        continue;
      }
      wait = std::min(wait, *poll_from - now);
    }
    const struct timespec slice = absl::ToTimespec(wait);
    // A signal ends the wait early (EINTR) without a timeout: the daemon's
    // lock is checked then too, so that signals arriving more often than a
    // slice (a profiler's SIGPROF, a timer) cannot hide a dead daemon until
    // the deadline.
    if (Futex(Word(sc::kResponseSeqOffset), FUTEX_WAIT, seen, &slice) != 0 &&
        (errno == ETIMEDOUT || errno == EINTR) && DaemonGone()) {
      return absl::UnavailableError(
          "its step channel's lock is gone (the daemon's process ended) "
          "before it answered");
    }
  }
}

void StepChannel::PollAnswer(absl::Time until) const {
  std::atomic_ref<uint32_t> response_seq(*Word(sc::kResponseSeqOffset));
  while (response_seq.load(std::memory_order_acquire) != seq_ &&
         absl::Now() < until) {
    sched_yield();
  }
}

// No daemon holds its lock, and no answer came before it went.
bool StepChannel::DaemonGone() const {
  return !sc::LockHeldByOther(fd_, sc::kDaemonLockByte) &&
         std::atomic_ref<uint32_t>(*Word(sc::kResponseSeqOffset))
                 .load(std::memory_order_acquire) != seq_;
}

StepChannel::Reply StepChannel::ReadAnswer() const {
  const uint32_t kind = *Word(sc::kResponseKindOffset);
  const uint32_t length = *Word(sc::kResponseLenOffset);
  if (kind == sc::kTooLarge) return {Outcome::kTooLarge};
  const bool known = kind == sc::kStepResponse || kind == sc::kRpcStatus;
  if (!known || length > capacities_.response) {
    return Failed(absl::InternalError(
        absl::StrCat("the daemon's step channel answered kind ", kind, " of ",
                     length, " bytes")));
  }
  const char* data = base_ + sc::ResponseOffset(capacities_.request);
  if (kind == sc::kRpcStatus) {
    if (std::optional<absl::Status> refusal =
            FromRpcStatusBytes(absl::string_view(data, length))) {
      return {Outcome::kAnswered, *std::move(refusal)};
    }
  } else if (v1::StepResponse response;
             response.ParseFromArray(data, static_cast<int>(length))) {
    return {Outcome::kAnswered, std::move(response)};
  }
  return Failed(absl::InternalError(
      absl::StrCat("the daemon's step channel answered ", length,
                   " bytes of kind ", kind, " that do not parse")));
}

void StepChannel::Close() {
  if (fd_ < 0) return;
  const bool ours = getpid() == pid_;
  // A broken channel's daemon may still be busy with its step: the lock
  // dropped below tells it, a close op could be read as a second request.
  if (ours && opened_ && !broken_ && base_ != nullptr) Post(sc::kOpClose, 0);
  Release(/*unlock=*/ours);
}

void StepChannel::Release(bool unlock) {
  // Untracked and closed with no fork between (see Create).
  std::lock_guard<std::mutex> no_fork(TrackedMutex());
  Tracked().erase(this);
  if (base_ != nullptr) munmap(base_, size_);
  base_ = nullptr;
  if (unlock) {
    struct flock lock = sc::OneByte(F_UNLCK, sc::kTrainerLockByte);
    fcntl(fd_, F_OFD_SETLK, &lock);
  }
  close(fd_);
  fd_ = -1;
}

// A forked child shares the parent's open file description: its descriptor
// and mapping would keep the trainer's lock alive past the parent's death,
// hiding it from the daemon. So the child lets go of both at once, without
// unlocking (the lock is the parent's too). Runs single-threaded in the
// child; the mutex was taken before the fork.
void StepChannel::ForgetAllInForkedChild() {
  std::set<StepChannel*> channels;
  channels.swap(Tracked());
  TrackedMutex().unlock();
  for (StepChannel* channel : channels) {
    if (channel->base_ != nullptr) munmap(channel->base_, channel->size_);
    channel->base_ = nullptr;
    close(channel->fd_);
    channel->fd_ = -1;
  }
}

void StepChannel::InstallForkHandler() {
  static std::once_flag handler;
  std::call_once(handler, [] {
    pthread_atfork([] { TrackedMutex().lock(); },
                   [] { TrackedMutex().unlock(); }, &ForgetAllInForkedChild);
  });
}

}  // namespace muond
