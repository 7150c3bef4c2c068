// Multi-process Gloo tests: each rank is a forked child that rendezvous
// through a FileKeyValueStore in a fresh directory and talks TCP over
// loopback. Children return 0 on success and a distinct code per failed
// check (printing the status to stderr).
#include "core/comm/gloo_communicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "tests/core/comm/exchange_pattern.h"
#include "tests/core/comm/multiprocess.h"

namespace muond {
namespace {

using ::muond::testing::ExpectedRecv;
using ::muond::testing::IdleRankOneCount;
using ::muond::testing::MakeTempDir;
using ::muond::testing::RunRanks;
using ::muond::testing::SameBytes;
using ::muond::testing::SendBuffer;
using ::muond::testing::UnevenCount;

GlooOptions TestOptions() {
  GlooOptions options;
  options.hostname = "127.0.0.1";
  options.timeout = absl::Seconds(5);
  return options;
}

int Fail(int rank, const char* what, const absl::Status& st) {
  std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, st.ToString().c_str());
  return 1;
}

template <typename T>
DType DTypeOf() {
  return sizeof(T) == 2 ? DType::kBFloat16 : DType::kFloat32;
}

// Three rounds of all_to_allv with the counts of `count`, each checked
// against the exchange computed by plain loops.
template <typename T, typename CountFn>
int AllToAllRank(int rank, int size, const std::string& dir, CountFn count) {
  FileKeyValueStore store(dir);
  auto comm =
      CreateGlooCommunicator(&store, "job/a2a", rank, size, TestOptions());
  if (!comm.ok()) return Fail(rank, "create", comm.status());
  for (int round = 0; round < 3; ++round) {
    std::vector<int64_t> send_counts, recv_counts;
    std::vector<T> send = SendBuffer<T>(rank, size, round, count, &send_counts);
    std::vector<T> want =
        ExpectedRecv<T>(rank, size, round, count, &recv_counts);
    std::vector<T> recv(want.size(), T{});
    absl::Status st = (*comm)->AllToAllV(
        send.empty() ? nullptr : send.data(), send_counts,
        recv.empty() ? nullptr : recv.data(), recv_counts, DTypeOf<T>());
    if (!st.ok()) return Fail(rank, "all_to_allv", st);
    if (!SameBytes(recv, want)) {
      std::fprintf(stderr, "rank %d round %d: wrong all_to_allv result\n", rank,
                   round);
      return 2;
    }
  }
  return 0;
}

template <typename T>
int AllGatherRank(int rank, int size, const std::string& dir,
                  const std::string& prefix) {
  FileKeyValueStore store(dir);
  auto comm = CreateGlooCommunicator(&store, prefix, rank, size, TestOptions());
  if (!comm.ok()) return Fail(rank, "create", comm.status());
  for (int64_t count : {3, 1, 0}) {
    std::vector<T> send, want;
    for (int64_t i = 0; i < count; ++i) {
      send.push_back(testing::Encode<T>(rank, 0, i, 1));
    }
    for (int src = 0; src < size; ++src) {
      for (int64_t i = 0; i < count; ++i) {
        want.push_back(testing::Encode<T>(src, 0, i, 1));
      }
    }
    std::vector<T> recv(want.size(), T{});
    absl::Status st =
        (*comm)->AllGather(send.empty() ? nullptr : send.data(), count,
                           recv.empty() ? nullptr : recv.data(), DTypeOf<T>());
    if (!st.ok()) return Fail(rank, "all_gather", st);
    if (!SameBytes(recv, want)) return 2;
    st = (*comm)->Barrier();
    if (!st.ok()) return Fail(rank, "barrier", st);
  }
  return (*comm)->Wait().ok() ? 0 : 3;
}

std::vector<int> Zeros(int n) { return std::vector<int>(n, 0); }

TEST(GlooCommunicator, AllToAllVUnevenAndZeroCountsFp32) {
  for (int size = 1; size <= 4; ++size) {
    SCOPED_TRACE(size);
    const std::string dir = MakeTempDir();
    EXPECT_EQ(RunRanks(size,
                       [&](int rank) {
                         return AllToAllRank<float>(rank, size, dir,
                                                    UnevenCount);
                       }),
              Zeros(size));
  }
}

TEST(GlooCommunicator, AllToAllVUnevenAndZeroCountsBf16) {
  for (int size = 1; size <= 4; ++size) {
    SCOPED_TRACE(size);
    const std::string dir = MakeTempDir();
    EXPECT_EQ(RunRanks(size,
                       [&](int rank) {
                         return AllToAllRank<uint16_t>(rank, size, dir,
                                                       UnevenCount);
                       }),
              Zeros(size));
  }
}

// Rank 1 has nothing to send or receive and passes null buffers.
TEST(GlooCommunicator, AllToAllVWithAnIdleRank) {
  for (int size = 2; size <= 4; ++size) {
    SCOPED_TRACE(size);
    const std::string dir = MakeTempDir();
    EXPECT_EQ(RunRanks(size,
                       [&](int rank) {
                         return AllToAllRank<float>(rank, size, dir,
                                                    IdleRankOneCount);
                       }),
              Zeros(size));
  }
}

TEST(GlooCommunicator, AllGatherAndBarrier) {
  for (int size = 1; size <= 4; ++size) {
    SCOPED_TRACE(size);
    const std::string dir = MakeTempDir();
    EXPECT_EQ(RunRanks(size,
                       [&](int rank) {
                         int fp32 = AllGatherRank<float>(rank, size, dir,
                                                         "job/gather-fp32");
                         if (fp32 != 0) return fp32;
                         return AllGatherRank<uint16_t>(rank, size, dir,
                                                        "job/gather-bf16");
                       }),
              Zeros(size));
  }
}

// Two groups in one process (threads) rendezvous through an in-memory store.
TEST(GlooCommunicator, ThreadsWithInMemoryStore) {
  InMemoryKeyValueStore store;
  constexpr int kSize = 3;
  std::vector<absl::Status> results(kSize);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kSize; ++rank) {
    threads.emplace_back([&, rank] {
      auto comm = CreateGlooCommunicator(&store, "job/threads", rank, kSize,
                                         TestOptions());
      if (!comm.ok()) {
        results[rank] = comm.status();
        return;
      }
      float mine = 10.0f * rank + 1.0f;
      std::vector<float> all(kSize, 0.0f);
      results[rank] = (*comm)->AllGather(&mine, 1, all.data(), DType::kFloat32);
      if (results[rank].ok() && all != std::vector<float>{1.0f, 11.0f, 21.0f}) {
        results[rank] = absl::InternalError("wrong all_gather result");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < kSize; ++rank) {
    EXPECT_TRUE(results[rank].ok()) << "rank " << rank << ": " << results[rank];
  }
}

// A peer that never shows up: rendezvous fails with DeadlineExceeded naming
// the key of the missing rank.
TEST(GlooCommunicator, AbsentPeerTimesOutAtRendezvous) {
  InMemoryKeyValueStore store;
  GlooOptions options = TestOptions();
  options.timeout = absl::Milliseconds(500);
  auto comm = CreateGlooCommunicator(&store, "job/absent", 0, 2, options);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded)
      << comm.status();
  EXPECT_TRUE(absl::StrContains(comm.status().message(), "job/absent/gloo/1"))
      << comm.status();
}

// A rendezvous whose result is no longer wanted (GlooOptions.cancelled) stops
// with Cancelled naming the missing key, long before its timeout.
TEST(GlooCommunicator, CancelledRendezvousStopsWaiting) {
  InMemoryKeyValueStore store;
  std::atomic<bool> cancel{false};
  GlooOptions options = TestOptions();
  options.timeout = absl::Hours(1);  // only the cancellation can end it
  options.cancelled = [&] { return cancel.load(); };
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(50));
    cancel = true;
  });
  auto comm = CreateGlooCommunicator(&store, "job/cancelled", 0, 2, options);
  canceller.join();
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kCancelled)
      << comm.status();
  EXPECT_TRUE(
      absl::StrContains(comm.status().message(), "job/cancelled/gloo/1"))
      << comm.status();
}

// A peer that exits after rendezvous: the survivors' next collective returns
// an error naming the group and the operation (within the 5 s timeout; the
// Bazel test timeout catches a hang), and the communicator stays closed.
TEST(GlooCommunicator, PeerThatExitsMakesSurvivorsFail) {
  const std::string dir = MakeTempDir();
  constexpr int kSize = 3;
  std::vector<int> codes = RunRanks(kSize, [&](int rank) {
    FileKeyValueStore store(dir);
    auto comm =
        CreateGlooCommunicator(&store, "job/dead", rank, kSize, TestOptions());
    if (!comm.ok()) return Fail(rank, "create", comm.status());
    absl::Status st = (*comm)->Barrier();
    if (!st.ok()) return Fail(rank, "first barrier", st);
    if (rank == kSize - 1) _exit(0);  // dies without a word
    std::vector<float> send(kSize, 1.0f), recv(kSize, 0.0f);
    std::vector<int64_t> counts(kSize, 1);
    st = (*comm)->AllToAllV(send.data(), counts, recv.data(), counts,
                            DType::kFloat32);
    std::fprintf(stderr, "rank %d got (expected an error): %s\n", rank,
                 st.ToString().c_str());
    if (st.ok()) return 10;
    if (st.code() != absl::StatusCode::kDeadlineExceeded &&
        st.code() != absl::StatusCode::kUnavailable) {
      return 11;
    }
    if (!absl::StrContains(st.message(), "job/dead") ||
        !absl::StrContains(st.message(), "all_to_allv")) {
      return 12;
    }
    st = (*comm)->Barrier();
    if (st.code() != absl::StatusCode::kAborted) return 13;
    return 0;
  });
  EXPECT_EQ(codes, Zeros(kSize));
}

// A peer that is alive but never joins the collective: the operation times
// out with DeadlineExceeded instead of hanging.
TEST(GlooCommunicator, SilentPeerTimesOut) {
  const std::string dir = MakeTempDir();
  std::vector<int> codes = RunRanks(2, [&](int rank) {
    FileKeyValueStore store(dir);
    GlooOptions options = TestOptions();
    options.timeout = absl::Seconds(1);
    auto comm = CreateGlooCommunicator(&store, "job/silent", rank, 2, options);
    if (!comm.ok()) return Fail(rank, "create", comm.status());
    if (rank == 1) {
      return store.Get("rank0-done", absl::Seconds(30)).ok() ? 0 : 30;
    }
    float mine = 1.0f, all[2] = {};
    absl::Status st = (*comm)->AllGather(&mine, 1, all, DType::kFloat32);
    std::fprintf(stderr, "rank 0 got (expected a timeout): %s\n",
                 st.ToString().c_str());
    (void)store.Set("rank0-done", "");
    if (st.code() != absl::StatusCode::kDeadlineExceeded) return 31;
    return absl::StrContains(st.message(), "job/silent") ? 0 : 32;
  });
  EXPECT_EQ(codes, Zeros(2));
}

// Abort() on a live rank makes its peer fail (the connections close) and
// its own later calls fail with Aborted.
TEST(GlooCommunicator, AbortMakesPeersFail) {
  const std::string dir = MakeTempDir();
  std::vector<int> codes = RunRanks(2, [&](int rank) {
    FileKeyValueStore store(dir);
    auto comm =
        CreateGlooCommunicator(&store, "job/abort", rank, 2, TestOptions());
    if (!comm.ok()) return Fail(rank, "create", comm.status());
    if (rank == 1) {
      (*comm)->Abort();
      if ((*comm)->Barrier().code() != absl::StatusCode::kAborted) {
        return 20;
      }
      // Stay alive until rank 0 saw the failure, so it is Abort, not exit,
      // that rank 0 observes.
      return store.Get("rank0-done", absl::Seconds(30)).ok() ? 0 : 21;
    }
    absl::Status st = (*comm)->Barrier();
    std::fprintf(stderr, "rank 0 got (expected an error): %s\n",
                 st.ToString().c_str());
    (void)store.Set("rank0-done", "");
    if (st.ok()) return 22;
    return absl::StrContains(st.message(), "barrier") ? 0 : 23;
  });
  EXPECT_EQ(codes, Zeros(2));
}

// Rank 1's store: Set passes; a Get of rank 0's address key ("<prefix>/0")
// runs `on_peer_address` instead (a rank that published its own address,
// then failed or hung before connecting).
class RankOneStore : public KeyValueStore {
 public:
  RankOneStore(KeyValueStore* base,
               std::function<absl::StatusOr<std::string>()> on_peer_address)
      : base_(base), on_peer_address_(std::move(on_peer_address)) {}
  absl::Status Set(const std::string& key, const std::string& value) override {
    return base_->Set(key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override {
    if (absl::EndsWith(key, "/gloo/0")) return on_peer_address_();
    return base_->Get(key, timeout);
  }

 private:
  KeyValueStore* base_;
  std::function<absl::StatusOr<std::string>()> on_peer_address_;
};

// Runs rank 0 on 127.0.0.1 and rank 1 on 127.0.0.2 of loopback, so Gloo
// makes rank 0 the listening side of their pair (the lower address waits for
// the higher to connect): rank 0 waits on rank 1, which never connects.
// Returns rank 0's result and how long it took.
struct RankZeroOutcome {
  absl::Status status;
  absl::Duration took;
};
RankZeroOutcome RunListenerWithBrokenPeer(
    const std::string& prefix, absl::Duration timeout,
    std::function<absl::StatusOr<std::string>()> rank1_on_peer_address,
    absl::Notification* rank0_done, std::function<bool()> cancelled = {}) {
  InMemoryKeyValueStore store;
  RankOneStore rank1_store(&store, std::move(rank1_on_peer_address));
  std::thread rank1([&] {
    GlooOptions options = TestOptions();
    options.hostname = "127.0.0.2";
    options.timeout = timeout;
    (void)CreateGlooCommunicator(&rank1_store, prefix, 1, 2, options);
  });
  GlooOptions options = TestOptions();
  options.timeout = timeout;
  options.cancelled = std::move(cancelled);
  const absl::Time start = absl::Now();
  auto comm = CreateGlooCommunicator(&store, prefix, 0, 2, options);
  RankZeroOutcome out{comm.status(), absl::Now() - start};
  std::fprintf(stderr, "rank 0 got (expected an error) after %s: %s\n",
               absl::FormatDuration(out.took).c_str(),
               out.status.ToString().c_str());
  rank0_done->Notify();
  rank1.join();
  return out;
}

// A peer whose rendezvous fails after it published its address (in the
// two-node test: it could not connect to an address that is not reachable
// from its node) makes its peers fail at once, naming it and its error,
// instead of leaving them waiting for a connection that will never come
// (Gloo waits 5x the timeout for it).
TEST(GlooCommunicator, PeerThatFailsItsRendezvousIsNamedAtOnce) {
  absl::Notification rank0_done;
  const absl::Duration timeout = absl::Seconds(30);
  RankZeroOutcome out = RunListenerWithBrokenPeer(
      "job/failing", timeout,
      [] {
        return absl::UnavailableError(
            "connect [10.9.9.9]:4711: Connection refused (injected)");
      },
      &rank0_done);
  ASSERT_FALSE(out.status.ok());
  EXPECT_EQ(out.status.code(), absl::StatusCode::kUnavailable) << out.status;
  EXPECT_TRUE(absl::StrContains(out.status.message(), "rank 1")) << out.status;
  EXPECT_TRUE(absl::StrContains(out.status.message(), "(injected)"))
      << out.status;
  // Generous: it takes about one store poll; the bug waited 5x the timeout.
  EXPECT_LT(out.took, timeout) << out.status;
}

// A peer that published its address and then hangs (never connects, never
// reports): the rendezvous ends at its timeout, naming the peer, not after
// Gloo's 5x connect wait (no time bound here: the machine may be loaded).
TEST(GlooCommunicator, PeerThatNeverConnectsTimesOutWithinTheTimeout) {
  absl::Notification rank0_done;
  const absl::Duration timeout = absl::Seconds(2);
  RankZeroOutcome out = RunListenerWithBrokenPeer(
      "job/hanging", timeout,
      [&]() -> absl::StatusOr<std::string> {
        rank0_done.WaitForNotification();
        return absl::DeadlineExceededError("rank 1 hung (injected)");
      },
      &rank0_done);
  ASSERT_FALSE(out.status.ok());
  EXPECT_EQ(out.status.code(), absl::StatusCode::kDeadlineExceeded)
      << out.status;
  // Only the rendezvous' own deadline (1x the timeout) says this; Gloo's
  // wait (5x) ends with "Connect timeout <address>".
  EXPECT_TRUE(absl::StrContains(out.status.message(),
                                "rank 1 did not connect within 2s"))
      << out.status;
}

// Cancelling a rank that waits for a peer's connection stops it at once
// (a daemon whose trainer unregistered must not wait out Gloo's connect).
TEST(GlooCommunicator, CancelStopsAWaitForAPeersConnection) {
  absl::Notification rank0_done;
  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(300));
    cancel = true;
  });
  RankZeroOutcome out = RunListenerWithBrokenPeer(
      "job/cancel-connect", absl::Hours(1),  // only the cancellation ends it
      [&]() -> absl::StatusOr<std::string> {
        rank0_done.WaitForNotification();
        return absl::CancelledError("rank 1 gave up too (injected)");
      },
      &rank0_done, [&] { return cancel.load(); });
  canceller.join();
  EXPECT_EQ(out.status.code(), absl::StatusCode::kCancelled) << out.status;
  EXPECT_TRUE(absl::StrContains(out.status.message(), "connecting to rank 1"))
      << out.status;
}

TEST(GlooCommunicator, RejectsBadArguments) {
  InMemoryKeyValueStore store;
  EXPECT_EQ(
      CreateGlooCommunicator(&store, "p", 2, 2, TestOptions()).status().code(),
      absl::StatusCode::kInvalidArgument);
  GlooOptions zero = TestOptions();
  zero.timeout = absl::ZeroDuration();
  EXPECT_EQ(CreateGlooCommunicator(&store, "p", 0, 2, zero).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      CreateGlooCommunicator(nullptr, "p", 0, 2, TestOptions()).status().code(),
      absl::StatusCode::kInvalidArgument);
  // Size 1 needs no store and no peers.
  auto local = CreateGlooCommunicator(nullptr, "p", 0, 1, TestOptions());
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ((*local)->size(), 1);
}

}  // namespace
}  // namespace muond
