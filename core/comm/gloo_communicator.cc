#include "core/comm/gloo_communicator.h"

#include <gloo/allgather.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/common/error_reason.h"
#include "core/common/status_macros.h"

namespace muond {
namespace {

constexpr char kBackend[] = "gloo";

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// gloo::rendezvous::Store over our KeyValueStore. Gloo expects exceptions;
// the first failing Status is kept so the boundary can return it unchanged
// (DeadlineExceeded naming the missing key rather than a generic message).
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(KeyValueStore* store, absl::Duration timeout)
      : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_->Set(key, std::string(data.begin(), data.end())));
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_->Get(key, timeout_);
    Check(value.status());
    return std::vector<char>(value->begin(), value->end());
  }

  void wait(const std::vector<std::string>& keys) override {
    wait(keys, ToChrono(timeout_));
  }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    // Gloo passes kNoTimeout (0) to mean "no limit"; we always keep ours.
    absl::Duration limit =
        timeout.count() > 0
            ? std::min(absl::Milliseconds(timeout.count()), timeout_)
            : timeout_;
    const absl::Time deadline = absl::Now() + limit;
    for (const std::string& key : keys) {
      absl::Duration left =
          std::max(deadline - absl::Now(), absl::ZeroDuration());
      Check(store_->Get(key, left).status());
    }
  }

  const absl::Status& first_error() const { return first_error_; }

 private:
  void Check(const absl::Status& status) {
    if (status.ok()) return;
    if (first_error_.ok()) first_error_ = status;
    throw gloo::IoException(std::string(status.message()));
  }

  KeyValueStore* store_;
  absl::Duration timeout_;
  absl::Status first_error_;
};

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
  CancellableStore cancellable(store, options.cancelled);
  PrefixStore group_store(&cancellable, absl::StrCat(prefix, "/gloo"));
  GlooStoreAdapter adapter(&group_store, options.timeout);
  std::shared_ptr<gloo::rendezvous::Context> context;
  absl::Status status = CallGloo(where, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    attr.iface = options.iface;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context->setTimeout(ToChrono(options.timeout));
    context->connectFullMesh(adapter, device);
    // A rank's connectFullMesh can return before its peers' do; without
    // this barrier a rank that fails or aborts right after creation would
    // break its peers' rendezvous instead of their first operation.
    gloo::BarrierOptions barrier(context);
    barrier.setTimeout(ToChrono(options.timeout));
    gloo::barrier(barrier);
  });
  if (!status.ok()) {
    if (!adapter.first_error().ok()) {
      return WithContext(adapter.first_error(), where);
    }
    return status;
  }
  return std::unique_ptr<Communicator>(new GlooCommunicator(
      rank, size, prefix, std::move(context), options.timeout));
}

}  // namespace muond
