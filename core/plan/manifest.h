#pragma once
// Param manifests: the JSON list of 2-D Muon weights of a model, by FULL shape,
// independent of the domain (used by `muonctl plan` and bench/plan).
//
//   {"model": "...", "params": [
//     {"name": "layers.0.q", "shape": [4096, 4096], "tp_dim": 0,
//      "gtp_sharded": true, "pad_length": 0}, ...]}
// or just the list. tp_dim: 0, 1, -1 or null (default -1); gtp_sharded
// default false; pad_length absent or null = the smallest padding that makes
// the TP-local dim 0 divisible by G.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan/sharding.h"

namespace muond {

struct ManifestParam {
  std::string name;
  std::vector<int64_t> shape;  // full shape
  int tp_dim = -1;
  bool gtp_sharded = false;
  int64_t pad_length = -1;  // -1: choose for the domain
};

struct Manifest {
  std::string model;
  std::vector<ManifestParam> params;
};

// Errors (InvalidArgument): malformed JSON, a missing or mistyped field (the
// message names the entry index and, when known, the param).
absl::StatusOr<Manifest> ParseManifest(std::string_view json_text);
absl::StatusOr<Manifest> LoadManifestFile(const std::string& path);

// The specs of every manifest param in `domain` (MakeShardSpecFromFullShape).
absl::StatusOr<std::vector<ParamShardSpec>> ManifestSpecs(
    const Manifest& manifest, DomainSize domain);

}  // namespace muond
