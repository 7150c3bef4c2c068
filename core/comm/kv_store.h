#pragma once
// A minimal key/value store for rendezvous: Gloo exchanges its TCP addresses
// through it and NCCL its unique id. Implementations: a directory of files
// (processes on one host or a shared file system), an in-process map (tests),
// and later the coordinator's store over gRPC. Values are opaque bytes.
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace muond {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;

  // Stores `value` under `key`, replacing any earlier value. Readers see
  // either the old or the new value in full, never a partial one.
  virtual absl::Status Set(const std::string& key,
                           const std::string& value) = 0;

  // Returns the value of `key`, blocking until some process sets it.
  // Errors: DeadlineExceeded (naming the key) when it is not set within
  // `timeout`; InvalidArgument for a key the store cannot represent.
  virtual absl::StatusOr<std::string> Get(const std::string& key,
                                          absl::Duration timeout) = 0;
};

// Thread-safe map for processes that share an address space (tests, one
// daemon hosting several groups).
class InMemoryKeyValueStore : public KeyValueStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

// One file per key in `dir` (which must exist). Set writes a temporary file
// and renames it over the key's file, so a reader never sees a partial value.
// Get polls (1 ms growing to 50 ms). Keys may hold any bytes: they are
// percent-encoded into file names; an encoded name over 240 bytes is
// InvalidArgument.
class FileKeyValueStore : public KeyValueStore {
 public:
  explicit FileKeyValueStore(std::string dir);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;

  const std::string& dir() const { return dir_; }

 private:
  absl::StatusOr<std::string> PathOf(const std::string& key) const;

  std::string dir_;
};

// Namespaces every key of `base` under `prefix` + "/" (one prefix per job,
// domain, group and plan version, so stale keys of an earlier communicator
// are never read). Does not own `base`. Prefixes nest.
class PrefixStore : public KeyValueStore {
 public:
  PrefixStore(KeyValueStore* base, std::string prefix);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;

  const std::string& prefix() const { return prefix_; }

 private:
  std::string FullKey(const std::string& key) const;

  KeyValueStore* base_;
  std::string prefix_;
};

// Passes everything to `base` (not owned) but gives up waiting once
// `cancelled()` turns true: Get waits on `base` in slices of at most `slice`
// and checks between them, so a rendezvous whose result nobody wants any more
// (a daemon whose trainer unregistered while it waited for peers) returns
// Cancelled, naming the key, within one slice instead of at the timeout.
// `cancelled` is called from the waiting thread and must be thread-safe.
class CancellableStore : public KeyValueStore {
 public:
  CancellableStore(KeyValueStore* base, std::function<bool()> cancelled,
                   absl::Duration slice = absl::Milliseconds(200));

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout) override;

 private:
  KeyValueStore* base_;
  std::function<bool()> cancelled_;
  absl::Duration slice_;
};

}  // namespace muond
