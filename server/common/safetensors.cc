#include "server/common/safetensors.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace muond {
namespace {

using Json = nlohmann::json;

// Names from a file are echoed in errors; a hostile file must not make them
// unbounded.
std::string Quoted(const std::string& s) {
  constexpr size_t kMax = 128;
  if (s.size() <= kMax) return absl::StrCat("'", s, "'");
  return absl::StrCat("'", s.substr(0, kMax), "...' (", s.size(), " bytes)");
}

std::string ErrnoText(int err) { return std::strerror(err); }

absl::Status IoError(const std::string& what, const std::string& path,
                     int err) {
  const std::string msg =
      absl::StrCat(what, " state file '", path, "': ", ErrnoText(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  return absl::UnavailableError(msg);
}

// Closes the descriptor on every path out.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // close(2) reports deferred write errors (NFS): the writer checks it.
  int Close() {
    const int rc = close(fd_);
    fd_ = -1;
    return rc;
  }

 private:
  int fd_;
};

bool WriteAll(int fd, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    size -= size_t(n);
  }
  return true;
}

// 0 on success, else the errno (EIO for a file that ended early).
int PreadAll(int fd, void* data, size_t size, uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = pread(fd, p, size, off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;  // shrank while being read
    p += n;
    size -= size_t(n);
    offset += uint64_t(n);
  }
  return 0;
}

std::string Directory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// "<path>.tmp.<16 random hex digits>": unpredictable, so no one can plant a
// file or symlink there in advance (and O_EXCL|O_NOFOLLOW refuses one anyway).
std::string TempName(const std::string& path) {
  unsigned char bytes[8] = {};
  if (getrandom(bytes, sizeof bytes, 0) != sizeof bytes) {
    // Still unique per attempt; O_EXCL keeps it safe.
    const uint64_t fallback = uint64_t(getpid()) * 0x9E3779B97F4A7C15ull ^
                              uint64_t(reinterpret_cast<uintptr_t>(bytes));
    std::memcpy(bytes, &fallback, sizeof bytes);
  }
  std::string hex;
  for (unsigned char b : bytes)
    absl::StrAppend(&hex, absl::Hex(b, absl::kZeroPad2));
  return absl::StrCat(path, ".tmp.", hex);
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The header JSON, padded so the data starts 8-byte aligned.
absl::StatusOr<std::string> HeaderJson(const SafetensorsFile& file,
                                       uint64_t* data_bytes) {
  Json header = Json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", Quoted(name), ": negative dimension"));
      }
    }
    if (Numel(t.shape) != int64_t(t.data.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quoted(name), ": shape does not match its ",
                       t.data.size(), " values"));
    }
    const uint64_t bytes = t.data.size() * sizeof(float);
    header[name] = {{"dtype", "F32"},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string json = header.dump();
  while (json.size() % 8 != 0) json.push_back(' ');
  *data_bytes = offset;
  return json;
}

absl::Status WriteContents(int fd, const std::string& temp,
                           const std::string& json, const SafetensorsFile& file,
                           const std::function<bool()>& cancelled) {
  const uint64_t n = json.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = (n >> (8 * i)) & 0xFF;
  if (!WriteAll(fd, len, 8) || !WriteAll(fd, json.data(), json.size())) {
    return IoError("cannot write", temp, errno);
  }
  for (const auto& [name, t] : file.tensors) {
    if (cancelled && cancelled()) {
      return absl::CancelledError(
          absl::StrCat("writing state file '", temp, "' was cancelled"));
    }
    if (!WriteAll(fd, t.data.data(), t.data.size() * sizeof(float))) {
      return IoError("cannot write", temp, errno);
    }
  }
  if (fsync(fd) != 0) return IoError("cannot fsync", temp, errno);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PreparedSafetensors> PrepareSafetensors(
    const std::string& path, const SafetensorsFile& file,
    const std::function<bool()>& cancelled) {
  if (path.empty())
    return absl::InvalidArgumentError("path: must not be empty");
  uint64_t data_bytes = 0;
  absl::StatusOr<std::string> json = HeaderJson(file, &data_bytes);
  if (!json.ok()) return json.status();
  // A directory in the way fails the rename only at commit, after the other
  // ranks of a job-wide save committed: refuse it while preparing.
  struct stat target;
  if (lstat(path.c_str(), &target) == 0 && S_ISDIR(target.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("state file '", path, "' is a directory"));
  }
  PreparedSafetensors prepared;
  prepared.path = path;
  int fd = -1;
  for (int attempt = 0; fd < 0 && attempt < 16; ++attempt) {
    prepared.temp_path = TempName(path);
    fd = open(prepared.temp_path.c_str(),
              O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) {
      return IoError("cannot create", prepared.temp_path, errno);
    }
  }
  if (fd < 0) return IoError("cannot create", prepared.temp_path, EEXIST);
  Fd out(fd);
  absl::Status st =
      WriteContents(out.get(), prepared.temp_path, *json, file, cancelled);
  if (st.ok() && out.Close() != 0) {
    st = IoError("cannot close", prepared.temp_path, errno);
  }
  if (!st.ok()) {
    unlink(prepared.temp_path.c_str());
    return st;
  }
  prepared.bytes = int64_t(8 + json->size() + data_bytes);
  return prepared;
}

absl::Status CommitSafetensors(const PreparedSafetensors& prepared) {
  if (rename(prepared.temp_path.c_str(), prepared.path.c_str()) != 0) {
    const int err = errno;
    unlink(prepared.temp_path.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot rename '", prepared.temp_path, "' to state file '",
                     prepared.path, "': ", ErrnoText(err)));
  }
  // The rename is durable only once the directory entry is on disk.
  const std::string dir = Directory(prepared.path);
  Fd d(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.get() < 0 || fsync(d.get()) != 0) {
    return absl::UnavailableError(
        absl::StrCat("state file '", prepared.path,
                     "' renamed, but cannot fsync its directory '", dir,
                     "': ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

void AbortSafetensors(const PreparedSafetensors& prepared) {
  if (!prepared.temp_path.empty()) unlink(prepared.temp_path.c_str());
}

absl::StatusOr<int64_t> WriteSafetensors(
    const std::string& path, const SafetensorsFile& file,
    const std::function<bool()>& cancelled) {
  absl::StatusOr<PreparedSafetensors> prepared =
      PrepareSafetensors(path, file, cancelled);
  if (!prepared.ok()) return prepared.status();
  if (absl::Status st = CommitSafetensors(*prepared); !st.ok()) return st;
  return prepared->bytes;
}

namespace {

// One tensor entry of the header, checked; `data_size` bounds its offsets.
struct TensorEntry {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

absl::StatusOr<TensorEntry> ParseEntry(const std::string& name, const Json& t,
                                       uint64_t data_size) {
  const auto bad = [&name](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", Quoted(name), " field '", field, "': ", why));
  };
  if (!t.is_object()) return bad("(entry)", "is not a JSON object");
  const auto dtype = t.find("dtype");
  if (dtype == t.end() || !dtype->is_string()) {
    return bad("dtype", "missing or not a string");
  }
  if (dtype->get<std::string>() != "F32") {
    return bad("dtype", absl::StrCat(Quoted(dtype->get<std::string>()),
                                     "; only F32 is supported"));
  }
  TensorEntry entry;
  entry.name = name;
  const auto shape = t.find("shape");
  if (shape == t.end() || !shape->is_array() || shape->size() > 8) {
    return bad("shape", "missing, not an array or more than 8 dimensions");
  }
  uint64_t numel = 1;
  for (const Json& d : *shape) {
    if (!d.is_number_unsigned()) {
      return bad("shape", "dimensions must be integers >= 0");
    }
    const uint64_t dim = d.get<uint64_t>();
    // Bounded by the data, so the product cannot overflow.
    if (dim > data_size / sizeof(float) + 1 ||
        (dim != 0 && numel > (data_size / sizeof(float) + 1) / dim)) {
      return bad("shape", "larger than the file's data");
    }
    numel *= dim;
    entry.shape.push_back(int64_t(dim));
  }
  const auto offsets = t.find("data_offsets");
  if (offsets == t.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    return bad("data_offsets", "must be [begin, end], integers >= 0");
  }
  entry.begin = (*offsets)[0].get<uint64_t>();
  entry.end = (*offsets)[1].get<uint64_t>();
  if (entry.begin > entry.end || entry.end > data_size) {
    return bad("data_offsets", absl::StrCat("[", entry.begin, ", ", entry.end,
                                            "] is not inside the data (",
                                            data_size, " bytes)"));
  }
  if (entry.end - entry.begin != numel * sizeof(float)) {
    return bad("data_offsets",
               absl::StrCat(entry.end - entry.begin, " bytes, the shape needs ",
                            numel * sizeof(float)));
  }
  return entry;
}

// The tensors must tile the data: no overlap (two tensors sharing bytes) and
// no gap (bytes no tensor owns), as the safetensors format requires.
absl::Status CheckTiling(std::vector<TensorEntry>& entries,
                         uint64_t data_size) {
  std::sort(entries.begin(), entries.end(),
            [](const TensorEntry& a, const TensorEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  uint64_t next = 0;
  for (const TensorEntry& e : entries) {
    if (e.begin != next) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Quoted(e.name), " field 'data_offsets': starts at ",
          e.begin, ", expected ", next,
          e.begin < next ? " (overlaps another tensor)" : " (leaves a gap)"));
    }
    next = e.end;
  }
  if (next != data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("data_offsets: the tensors cover ", next, " of the ",
                     data_size, " data bytes"));
  }
  return absl::OkStatus();
}

absl::Status ParseMetadata(const Json& m, SafetensorsFile* file) {
  if (!m.is_object()) {
    return absl::InvalidArgumentError("field '__metadata__': not an object");
  }
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (!it->is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat("field '__metadata__' key ", Quoted(it.key()),
                       ": values must be strings"));
    }
    file->metadata[it.key()] = it->get<std::string>();
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsFile> ReadOpened(
    int fd, uint64_t size, const std::string& path,
    const std::function<bool()>& cancelled) {
  const auto bad = [&path](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("state file '", path, "': ", why));
  };
  if (size < 8) return bad("shorter than its 8-byte header length");
  unsigned char len[8];
  if (int err = PreadAll(fd, len, 8, 0); err != 0) {
    return IoError("cannot read", path, err);
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  if (n > kMaxHeaderBytes) {
    return bad(absl::StrCat("header length ", n, " exceeds the limit of ",
                            kMaxHeaderBytes, " bytes"));
  }
  if (n > size - 8) {
    return bad(absl::StrCat("header length ", n, " runs past the file (", size,
                            " bytes)"));
  }
  std::string text(n, '\0');
  if (int err = PreadAll(fd, text.data(), n, 8); err != 0) {
    return IoError("cannot read", path, err);
  }
  const Json header = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return bad("header is not valid JSON");
  if (!header.is_object()) return bad("header is not a JSON object");
  const uint64_t data_start = 8 + n;
  const uint64_t data_size = size - data_start;
  SafetensorsFile file;
  std::vector<TensorEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    absl::Status st;
    if (it.key() == "__metadata__") {
      st = ParseMetadata(*it, &file);
    } else {
      absl::StatusOr<TensorEntry> e = ParseEntry(it.key(), *it, data_size);
      if (e.ok()) entries.push_back(*std::move(e));
      st = e.status();
    }
    if (!st.ok()) return bad(std::string(st.message()));
  }
  if (absl::Status st = CheckTiling(entries, data_size); !st.ok()) {
    return bad(std::string(st.message()));
  }
  for (const TensorEntry& e : entries) {
    if (cancelled && cancelled()) {
      return absl::CancelledError(
          absl::StrCat("reading state file '", path, "' was cancelled"));
    }
    Fp32Tensor tensor{e.shape, std::vector<float>((e.end - e.begin) / 4)};
    if (int err = PreadAll(fd, tensor.data.data(), e.end - e.begin,
                           data_start + e.begin);
        err != 0) {
      return IoError("cannot read", path, err);
    }
    file.tensors[e.name] = std::move(tensor);
  }
  return file;
}

}  // namespace

absl::StatusOr<SafetensorsFile> ReadSafetensors(
    const std::string& path, const std::function<bool()>& cancelled) {
  if (path.empty())
    return absl::InvalidArgumentError("path: must not be empty");
  // O_NONBLOCK: opening a FIFO must not wait for a writer; a regular file
  // ignores the flag.
  Fd fd(open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) return IoError("cannot open", path, errno);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return IoError("cannot stat", path, errno);
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("state file '", path,
                     "': not a regular file (a directory, FIFO, "
                     "device or socket)"));
  }
  return ReadOpened(fd.get(), uint64_t(st.st_size), path, cancelled);
}

}  // namespace muond
