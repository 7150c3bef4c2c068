#pragma once
// A minimal safetensors reader/writer for fp32 tensors (optimizer state,
// docs/ARCHITECTURE.md "Security and state"): 8-byte little-endian header
// length, a JSON header
// {"__metadata__": {string: string}, name: {"dtype": "F32", "shape": [...],
// "data_offsets": [begin, end]}}, then the raw data. Python's `safetensors`
// reads these files.
//
// The file rules live here. Writing: a temporary file next to the target,
// named unpredictably and created O_CREAT|O_EXCL|O_NOFOLLOW with mode 0600
// (a planted file or symlink is never followed or reused), fsync'd, renamed
// into place, then the directory fsync'd. Reading: only regular files
// (opened O_NONBLOCK, so a FIFO never blocks; /dev/zero and directories are
// refused), bounded by the file's size and kMaxHeaderBytes; the header must
// be a JSON object whose tensors' data_offsets tile the data exactly (no
// overlap, no gap, inside the file). Errors name the path, the field and,
// for I/O, the errno text.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace muond {

struct Fp32Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, Fp32Tensor> tensors;
};

// The largest JSON header a reader accepts (as Python's safetensors).
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// A complete, fsync'd file under a temporary name, not yet in place.
struct PreparedSafetensors {
  std::string path;       // where Commit puts it
  std::string temp_path;  // where it is now
  int64_t bytes = 0;
};

// Writes `file` to a new temporary file in `path`'s directory (see above) and
// fsyncs it. InvalidArgument when a tensor's shape does not match its data;
// Unavailable for I/O errors (naming the path and errno text); Cancelled when
// `cancelled` returns true between tensors (the temporary file is removed).
absl::StatusOr<PreparedSafetensors> PrepareSafetensors(
    const std::string& path, const SafetensorsFile& file,
    const std::function<bool()>& cancelled = {});
// Renames the temporary file into place and fsyncs the directory; on failure
// the temporary file is removed.
absl::Status CommitSafetensors(const PreparedSafetensors& prepared);
// Removes the temporary file (idempotent).
void AbortSafetensors(const PreparedSafetensors& prepared);

// Prepare + Commit. Returns the file size.
absl::StatusOr<int64_t> WriteSafetensors(
    const std::string& path, const SafetensorsFile& file,
    const std::function<bool()>& cancelled = {});

// NotFound when the path does not exist; Unavailable for other I/O errors;
// InvalidArgument for a non-regular file, a malformed file or a dtype other
// than F32 (naming the path, the tensor and the field); Cancelled when
// `cancelled` returns true between tensors.
absl::StatusOr<SafetensorsFile> ReadSafetensors(
    const std::string& path, const std::function<bool()>& cancelled = {});

}  // namespace muond
