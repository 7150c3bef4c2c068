#pragma once
// What the Newton–Schulz workspaces of one engine may take (NsRunner): at
// most a cap for all of them together (StepOptions::max_ns_workspace_bytes;
// 0: none), and never more than the backend's free memory less a reserve at
// the moment a workspace is built, since the device may be shared with other
// processes (the trainer's, anyone's). The runner asks before it builds an
// engine and splits a batch that does not fit (NsRunner::Plan), so a step
// fails for memory only when not even one matrix fits. Thread-safe: lanes
// build their engines at once.
#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/backend/backend.h"

namespace muond {

class NsWorkspaceBudget {
 public:
  // Free memory an engine leaves untouched: max(256 MiB, 2% of the total).
  static int64_t Reserve(const MemoryInfo& memory);

  explicit NsWorkspaceBudget(int64_t cap_bytes = 0) : cap_(cap_bytes) {}
  NsWorkspaceBudget(const NsWorkspaceBudget&) = delete;
  NsWorkspaceBudget& operator=(const NsWorkspaceBudget&) = delete;

  // Takes `bytes` for a workspace about to be allocated on `backend` when
  // they fit under the cap (with what is taken) and under the backend's free
  // memory less Reserve: true; false (nothing taken) otherwise. A backend that
  // reports no memory (Unimplemented) is held to the cap alone.
  absl::StatusOr<bool> TryTake(Backend& backend, int64_t bytes);
  void Give(int64_t bytes);

  // Held while a runner measures, takes and allocates (NsRunner::Plan), so
  // lanes building engines at once do not each count the same free memory.
  absl::Mutex& build_mutex() { return build_mu_; }

  int64_t cap() const { return cap_; }
  int64_t taken() const;
  // The most ever taken at once.
  int64_t peak() const;
  // "N bytes needed; F of T bytes free on <backend>, NS workspaces hold W
  // (cap C)": the numbers of a refusal.
  std::string Describe(Backend& backend, int64_t bytes) const;

 private:
  const int64_t cap_;
  absl::Mutex build_mu_;
  mutable absl::Mutex mu_;
  int64_t taken_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muond
