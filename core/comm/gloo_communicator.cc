#include "core/comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/context.h>
#include <gloo/transport/address.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

constexpr char kBackend[] = "gloo";

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Whether Gloo's I/O error is a timeout. Gloo (as Debian ships it) throws
// one type, gloo::IoException, for every I/O failure and says "timeout" only
// in the text ("Timed out waiting ...", "Read timeout", "Connect timeout"),
// so this third-party text is read here, at the boundary, and nowhere else:
// everything above sees DeadlineExceeded or Unavailable.
bool IsGlooTimeout(const gloo::IoException& e) {
  const absl::string_view text = e.what();
  return absl::StrContains(text, "imeout") ||
         absl::StrContains(text, "Timed out");
}

// Runs `fn` and turns whatever Gloo throws into a Status prefixed by `where`.
template <typename Fn>
absl::Status CallGloo(const std::string& where, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    if (IsGlooTimeout(e)) {
      return absl::DeadlineExceededError(absl::StrCat(
          where, "timed out (a peer is dead or slow): ", e.what()));
    }
    return absl::UnavailableError(
        absl::StrCat(where, "transport failed (a peer is gone?): ", e.what()));
  } catch (const gloo::EnforceNotMet& e) {
    return absl::InternalError(
        absl::StrCat(where, "gloo check failed: ", e.what()));
  } catch (const gloo::Exception& e) {
    return absl::InternalError(absl::StrCat(where, "gloo error: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(where, e.what()));
  } catch (...) {
    return absl::UnknownError(absl::StrCat(where, "unknown exception"));
  }
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int size, std::string name,
                   std::shared_ptr<gloo::Context> context,
                   absl::Duration timeout)
      : Communicator(rank, size, std::move(name)),
        context_(std::move(context)),
        timeout_(ToChrono(timeout)) {}

  ~GlooCommunicator() override {
    absl::MutexLock lock(&mu_);
    CloseLocked();
  }

  MemorySpace memory_space() const override { return MemorySpace::kHost; }

  absl::Status Barrier() override {
    absl::MutexLock lock(&mu_);
    return Run("barrier", [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

  absl::Status Wait() override {
    absl::MutexLock lock(&mu_);
    return CheckUsableLocked("wait");
  }

  void Abort() override {
    aborted_ = true;
    // An operation in flight closes the connections itself when it returns;
    // never block the aborting thread on it.
    if (mu_.TryLock()) {
      CloseLocked();
      mu_.Unlock();
    }
  }

 protected:
  absl::Status DoAllToAllV(const void* send,
                           absl::Span<const int64_t> send_counts, void* recv,
                           absl::Span<const int64_t> recv_counts,
                           DType dtype) override {
    absl::MutexLock lock(&mu_);
    std::vector<int64_t> send_v(send_counts.begin(), send_counts.end());
    std::vector<int64_t> recv_v(recv_counts.begin(), recv_counts.end());
    return Run("all_to_allv", [&] {
      gloo::AlltoallvOptions opts(context_);
      opts.setTimeout(timeout_);
      // Every rank takes part even with nothing to move (Gloo sends
      // zero-length messages), and Gloo wants non-null pointers.
      if (dtype == DType::kBFloat16) {
        SetBuffers<uint16_t>(opts, send, send_v, recv, recv_v);
      } else {
        SetBuffers<float>(opts, send, send_v, recv, recv_v);
      }
      gloo::alltoallv(opts);
    });
  }

  absl::Status DoAllGather(const void* send, int64_t count, void* recv,
                           DType dtype) override {
    absl::MutexLock lock(&mu_);
    if (count == 0) return CheckUsableLocked("all_gather");
    return Run("all_gather", [&] {
      gloo::AllgatherOptions opts(context_);
      opts.setTimeout(timeout_);
      if (dtype == DType::kBFloat16) {
        SetBuffers<uint16_t>(opts, send, count, recv);
      } else {
        SetBuffers<float>(opts, send, count, recv);
      }
      gloo::allgather(opts);
    });
  }

 private:
  template <typename T>
  static void SetBuffers(gloo::AlltoallvOptions& opts, const void* send,
                         const std::vector<int64_t>& send_counts, void* recv,
                         const std::vector<int64_t>& recv_counts) {
    static thread_local T dummy_in, dummy_out;
    T* in = send ? static_cast<T*>(const_cast<void*>(send)) : &dummy_in;
    T* out = recv ? static_cast<T*>(recv) : &dummy_out;
    opts.setInput(in, send_counts);
    opts.setOutput(out, recv_counts);
  }

  template <typename T>
  void SetBuffers(gloo::AllgatherOptions& opts, const void* send, int64_t count,
                  void* recv) {
    opts.setInput(static_cast<T*>(const_cast<void*>(send)),
                  static_cast<size_t>(count));
    opts.setOutput(static_cast<T*>(recv),
                   static_cast<size_t>(count) * static_cast<size_t>(size()));
  }

  absl::Status CheckUsableLocked(const char* op)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (aborted_ || context_ == nullptr) {
      return absl::AbortedError(absl::StrCat(
          ErrorContext(kBackend, op), "communicator was aborted",
          broken_by_.empty() ? "" : " after an earlier failure: ", broken_by_));
    }
    return absl::OkStatus();
  }

  // Runs one Gloo operation. A failed collective leaves the group's state
  // undefined, so the communicator aborts itself: peers still waiting on
  // this rank then fail at once instead of after their timeout.
  template <typename Fn>
  absl::Status Run(const char* op, Fn&& fn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    RETURN_IF_ERROR(CheckUsableLocked(op));
    absl::Status status = CallGloo(ErrorContext(kBackend, op), fn);
    if (!status.ok()) {
      broken_by_ = std::string(status.message());
      aborted_ = true;
    }
    if (aborted_) CloseLocked();
    return status;
  }

  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (context_ == nullptr) return;
    (void)CallGloo("close", [&] { context_->closeConnections(); });
    context_.reset();
  }

  absl::Mutex mu_;
  std::shared_ptr<gloo::Context> context_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> aborted_{false};
  std::string broken_by_ ABSL_GUARDED_BY(mu_);
  const std::chrono::milliseconds timeout_;
};

// A gloo::Context whose transport this file connects (Rendezvous) instead of
// Gloo's connectFullMesh.
class MeshContext : public gloo::Context {
 public:
  using gloo::Context::Context;
  void Adopt(std::shared_ptr<gloo::transport::Device> device,
             std::shared_ptr<gloo::transport::Context> transport) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

// Key (under "<prefix>/gloo") where a rank whose rendezvous failed leaves its
// error for its peers; the address keys are the ranks' numbers.
constexpr char kFailedKey[] = "failed";
// How often the watcher looks for a peer's failure (one store Get each).
constexpr absl::Duration kWatchSlice = absl::Milliseconds(50);

// One rank's rendezvous: Gloo's connectFullMesh rebuilt on Gloo's public pair
// API, so that it can be stopped. Gloo's TCP pair waits up to 5x its timeout
// for the peer to connect (the lower address listens, the higher connects),
// and nothing interrupts that wait but closing the pair: so a rank whose
// peer could not connect (an address not reachable from the peer's host)
// used to wait 5x the timeout while the peer had failed at once. Here a
// watcher thread closes this rank's pairs as soon as a peer reports a failed
// rendezvous (kFailedKey), the caller cancels, or connecting runs past the
// timeout; and a rank whose rendezvous fails reports it there. Waits: the
// peers' addresses within the timeout from the start, then the connections
// and the closing barrier within the timeout from when the last arrived.
class Rendezvous {
 public:
  Rendezvous(KeyValueStore* store, const std::string& prefix, int rank,
             int size, const GlooOptions& options, std::string where)
      : rank_(rank),
        size_(size),
        options_(options),
        where_(std::move(where)),
        raw_(store, absl::StrCat(prefix, "/gloo")),
        stoppable_(store,
                   [this] {
                     return stopped_.load() ||
                            (options_.cancelled && options_.cancelled());
                   }),
        group_(&stoppable_, absl::StrCat(prefix, "/gloo")) {}

  absl::StatusOr<std::shared_ptr<gloo::Context>> Run() {
    absl::StatusOr<std::shared_ptr<gloo::Context>> result = RunWatched();
    if (!result.ok() && !peer_failed_.load()) {
      // Best effort: a peer that misses it still ends at its own timeout.
      (void)raw_.Set(kFailedKey, std::string(result.status().message()));
    }
    return result;
  }

 private:
  absl::StatusOr<std::shared_ptr<gloo::Context>> RunWatched() {
    auto context = std::make_shared<MeshContext>(rank_, size_);
    context->setTimeout(ToChrono(options_.timeout));
    RETURN_IF_ERROR(CallGloo(where_, [&] { CreatePairs(); }));
    RETURN_IF_ERROR(raw_.Set(absl::StrCat(rank_), PairAddresses()));
    std::thread watcher([this] { Watch(); });
    absl::Status status = Connect();
    finished_.Notify();
    watcher.join();
    if (stopped_.load()) return StopReason();
    RETURN_IF_ERROR(status);
    context->Adopt(device_, transport_);
    // A rank's connections can be made before its peers' are; without this
    // barrier a rank that fails or aborts right after creation would break
    // its peers' rendezvous instead of their first operation.
    status = CallGloo(where_, [&] {
      gloo::BarrierOptions barrier(context);
      barrier.setTimeout(ToChrono(
          std::max(connect_deadline() - absl::Now(), absl::Milliseconds(1))));
      gloo::barrier(barrier);
    });
    if (!status.ok()) {
      // A peer that failed closed its connections after reporting why.
      absl::StatusOr<std::string> why =
          raw_.Get(kFailedKey, absl::ZeroDuration());
      if (why.ok()) return PeerFailed(*why);
      return status;
    }
    return context;
  }

  void CreatePairs() {
    gloo::transport::tcp::attr attr;
    attr.hostname = options_.hostname;
    attr.iface = options_.iface;
    device_ = gloo::transport::tcp::CreateDevice(attr);
    transport_ = device_->createContext(rank_, size_);
    transport_->setTimeout(ToChrono(options_.timeout));
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_) transport_->createPair(peer);
    }
  }

  // This rank's listening address for each peer, in rank order.
  std::string PairAddresses() {
    std::string all;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const std::vector<char> bytes =
          transport_->getPair(peer)->address().bytes();
      all.append(bytes.begin(), bytes.end());
    }
    return all;
  }

  // The address `peer` published for this rank.
  absl::StatusOr<std::vector<char>> AddressFrom(int peer, absl::Time deadline) {
    absl::StatusOr<std::string> got =
        group_.Get(absl::StrCat(peer),
                   std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!got.ok()) return WithContext(got.status(), where_);
    const std::string& all = *got;
    const size_t each = all.size() / size_t(size_ - 1);
    if (each == 0 || all.size() % size_t(size_ - 1) != 0) {
      return absl::InternalError(absl::StrCat(
          where_, "rank ", peer, " published ", all.size(),
          " bytes of addresses, not one per peer (", size_ - 1, ")"));
    }
    const size_t index = size_t(rank_ < peer ? rank_ : rank_ - 1);
    return std::vector<char>(all.begin() + index * each,
                             all.begin() + (index + 1) * each);
  }

  absl::Status Connect() {
    const absl::Time address_deadline = absl::Now() + options_.timeout;
    std::vector<std::vector<char>> addresses(size_);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      ASSIGN_OR_RETURN(addresses[peer], AddressFrom(peer, address_deadline));
    }
    {
      absl::MutexLock lock(&mu_);
      connect_deadline_ = absl::Now() + options_.timeout;
    }
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      if (stopped_.load()) break;
      connecting_to_ = peer;
      absl::Status status = CallGloo(
          absl::StrCat(where_, "connecting to rank ", peer, ": "),
          [&] { transport_->getPair(peer)->connect(addresses[peer]); });
      if (!status.ok() && !stopped_.load()) {
        return absl::Status(
            status.code(),
            absl::StrCat(status.message(), " (the address rank ", peer,
                         " published: is its GlooOptions.hostname, muond's "
                         "--gloo_hostname, reachable from this host?)"));
      }
    }
    return absl::OkStatus();
  }

  // Polls until Connect ends; stops it (closing every pair) for a peer's
  // reported failure, a cancellation or the connect deadline.
  void Watch() {
    while (!finished_.HasBeenNotified()) {
      const absl::Time deadline = connect_deadline();
      if (deadline != absl::InfiniteFuture()) {
        if (options_.cancelled && options_.cancelled()) {
          return Stop(absl::CancelledError(
              absl::StrCat(where_, "cancelled while connecting to rank ",
                           connecting_to_.load())));
        }
        if (absl::Now() >= deadline) {
          const int peer = connecting_to_.load();
          return Stop(absl::DeadlineExceededError(absl::StrCat(
              where_, "rank ", peer, " did not connect within ",
              absl::FormatDuration(options_.timeout),
              " (it published its address but is hung, or cannot reach "
              "this rank's: is GlooOptions.hostname an address its host "
              "can reach?)")));
        }
      }
      absl::StatusOr<std::string> why = raw_.Get(kFailedKey, kWatchSlice);
      if (why.ok()) return Stop(PeerFailed(*why));
      if (!absl::IsDeadlineExceeded(why.status())) {
        finished_.WaitForNotificationWithTimeout(kWatchSlice);  // store down
      }
    }
  }

  absl::Status PeerFailed(const std::string& why) {
    peer_failed_ = true;
    return absl::UnavailableError(absl::StrCat(
        where_,
        "a peer's rendezvous failed, so this one cannot complete: ", why));
  }

  void Stop(absl::Status reason) {
    {
      absl::MutexLock lock(&mu_);
      stop_reason_ = std::move(reason);
    }
    stopped_ = true;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      (void)CallGloo("close", [&] { transport_->getPair(peer)->close(); });
    }
  }

  absl::Status StopReason() {
    absl::MutexLock lock(&mu_);
    return stop_reason_;
  }

  absl::Time connect_deadline() {
    absl::MutexLock lock(&mu_);
    return connect_deadline_;
  }

  const int rank_;
  const int size_;
  const GlooOptions& options_;
  const std::string where_;
  PrefixStore raw_;             // the group's keys, never cancelled
  CancellableStore stoppable_;  // the caller's store, stopped with us
  PrefixStore group_;           // the group's keys over stoppable_
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::transport::Context> transport_;
  absl::Notification finished_;  // Connect has returned
  std::atomic<bool> stopped_{false};
  std::atomic<bool> peer_failed_{false};
  std::atomic<int> connecting_to_{-1};
  absl::Mutex mu_;
  absl::Time connect_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Status stop_reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(
    KeyValueStore* store, const std::string& prefix, int rank, int size,
    const GlooOptions& options) {
  RETURN_IF_ERROR(ValidateRankAndSize(rank, size));
  // Gloo's TCP pairs write with writev(): a peer that died would raise
  // SIGPIPE and kill this process instead of failing the collective with a
  // status. Ignore it once, process-wide (Python does the same at startup).
  static std::once_flag ignore_sigpipe;
  std::call_once(ignore_sigpipe, [] { std::signal(SIGPIPE, SIG_IGN); });
  if (options.timeout < absl::Milliseconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "GlooOptions.timeout = ", absl::FormatDuration(options.timeout),
        "; it must be >= 1ms"));
  }
  if (size == 1) return std::unique_ptr<Communicator>(new LocalCommunicator());
  if (store == nullptr) {
    return absl::InvalidArgumentError("store is null; size > 1 needs one");
  }

  const std::string where =
      absl::StrCat(kBackend, " group '", prefix, "' rank ", rank, "/", size,
                   ": rendezvous: ");
  Rendezvous rendezvous(store, prefix, rank, size, options, where);
  ASSIGN_OR_RETURN(std::shared_ptr<gloo::Context> context, rendezvous.Run());
  return std::unique_ptr<Communicator>(new GlooCommunicator(
      rank, size, prefix, std::move(context), options.timeout));
}

}  // namespace muond
