#include "core/comm/kv_store.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muond {
namespace {

absl::Status KeyNotSet(const std::string& key, absl::Duration timeout,
                       const std::string& where) {
  return absl::DeadlineExceededError(
      absl::StrCat("key '", key, "' was not set within ",
                   absl::FormatDuration(timeout), " in ", where));
}

// Keeps [A-Za-z0-9_-]; everything else (including '.', '/', '%') becomes %XX,
// so an encoded key never starts with '.', the mark of temporary files.
std::string EncodeFileName(const std::string& key) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : key) {
    if (isalnum(c) || c == '_' || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::UnavailableError(
      absl::StrCat(what, " '", path, "': ", strerror(errno)));
}

absl::Status WriteWholeFile(const std::string& path, const std::string& data) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoError("cannot create", path);
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status st = ErrnoError("cannot write", path);
      close(fd);
      return st;
    }
    done += static_cast<size_t>(n);
  }
  if (close(fd) != 0) return ErrnoError("cannot close", path);
  return absl::OkStatus();
}

// NotFound when the file does not exist yet.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return absl::NotFoundError(path);
    return ErrnoError("cannot open", path);
  }
  std::string out;
  char buf[4096];
  while (true) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      absl::Status st = ErrnoError("cannot read", path);
      close(fd);
      return st;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

}  // namespace

absl::Status InMemoryKeyValueStore::Set(const std::string& key,
                                        const std::string& value) {
  absl::MutexLock lock(&mu_);
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::string> InMemoryKeyValueStore::Get(const std::string& key,
                                                       absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto is_set = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return values_.count(key) > 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&is_set), timeout)) {
    return KeyNotSet(key, timeout, "the in-memory store");
  }
  return values_.at(key);
}

FileKeyValueStore::FileKeyValueStore(std::string dir) : dir_(std::move(dir)) {}

absl::StatusOr<std::string> FileKeyValueStore::PathOf(
    const std::string& key) const {
  std::string name = EncodeFileName(key);
  if (name.empty() || name.size() > 240) {
    return absl::InvalidArgumentError(
        absl::StrCat("key '", key, "' encodes to a file name of ", name.size(),
                     " bytes; FileKeyValueStore needs 1..240"));
  }
  return absl::StrCat(dir_, "/", name);
}

absl::Status FileKeyValueStore::Set(const std::string& key,
                                    const std::string& value) {
  absl::StatusOr<std::string> path = PathOf(key);
  if (!path.ok()) return path.status();
  // Unique within the host: pid + a per-process counter.
  static std::atomic<uint64_t> counter{0};
  std::string tmp = absl::StrCat(dir_, "/.tmp-", getpid(), "-", counter++);
  absl::Status written = WriteWholeFile(tmp, value);
  if (!written.ok()) {
    unlink(tmp.c_str());
    return written;
  }
  if (rename(tmp.c_str(), path->c_str()) != 0) {
    absl::Status st = ErrnoError("cannot rename temporary file to", *path);
    unlink(tmp.c_str());
    return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileKeyValueStore::Get(const std::string& key,
                                                   absl::Duration timeout) {
  absl::StatusOr<std::string> path = PathOf(key);
  if (!path.ok()) return path.status();
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = absl::Milliseconds(1);
  while (true) {
    absl::StatusOr<std::string> value = ReadWholeFile(*path);
    if (value.ok() || !absl::IsNotFound(value.status())) return value;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return KeyNotSet(key, timeout, absl::StrCat("file store '", dir_, "'"));
    }
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, absl::Milliseconds(50));
  }
}

PrefixStore::PrefixStore(KeyValueStore* base, std::string prefix)
    : base_(base), prefix_(std::move(prefix)) {}

std::string PrefixStore::FullKey(const std::string& key) const {
  return absl::StrCat(prefix_, "/", key);
}

absl::Status PrefixStore::Set(const std::string& key,
                              const std::string& value) {
  return base_->Set(FullKey(key), value);
}

absl::StatusOr<std::string> PrefixStore::Get(const std::string& key,
                                             absl::Duration timeout) {
  return base_->Get(FullKey(key), timeout);
}

CancellableStore::CancellableStore(KeyValueStore* base,
                                   std::function<bool()> cancelled,
                                   absl::Duration slice)
    : base_(base), cancelled_(std::move(cancelled)), slice_(slice) {}

absl::Status CancellableStore::Set(const std::string& key,
                                   const std::string& value) {
  return base_->Set(key, value);
}

absl::StatusOr<std::string> CancellableStore::Get(const std::string& key,
                                                  absl::Duration timeout) {
  if (!cancelled_) return base_->Get(key, timeout);
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (cancelled_()) {
      return absl::CancelledError(absl::StrCat(
          "stopped waiting for key '", key, "': the rendezvous was cancelled"));
    }
    const absl::Duration left = deadline - absl::Now();
    const bool last = left <= slice_;
    absl::StatusOr<std::string> value =
        base_->Get(key, last ? std::max(left, absl::ZeroDuration()) : slice_);
    // Only the last slice's DeadlineExceeded is the caller's timeout, and it
    // names the whole timeout.
    if (value.ok() || !absl::IsDeadlineExceeded(value.status())) return value;
    if (last) {
      return absl::DeadlineExceededError(absl::StrCat(
          "key '", key, "' was not set within ", absl::FormatDuration(timeout),
          " (last wait: ", value.status().message(), ")"));
    }
  }
}

}  // namespace muond
