#pragma once
// A minimal safetensors reader/writer for fp32 tensors (optimizer state,
// docs/ARCHITECTURE.md "Security and state"): 8-byte little-endian header
// length, a JSON header
// {"__metadata__": {string: string}, name: {"dtype": "F32", "shape": [...],
// "data_offsets": [begin, end]}}, then the raw data. Python's `safetensors`
// reads these files.
#include <cstdint>
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

// Writes atomically (temporary file in the same directory + rename).
// Returns the file size. InvalidArgument when a tensor's shape does not
// match its data; Unavailable for I/O errors (naming the path).
absl::StatusOr<int64_t> WriteSafetensors(const std::string& path,
                                         const SafetensorsFile& file);

// NotFound / Unavailable for I/O; InvalidArgument for a malformed file or a
// dtype other than F32 (naming the tensor).
absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path);

}  // namespace muond
