#include "server/common/safetensors.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace muond {
namespace {

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

absl::StatusOr<int64_t> WriteSafetensors(const std::string& path,
                                         const SafetensorsFile& file) {
  nlohmann::json header = nlohmann::json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (Numel(t.shape) != int64_t(t.data.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", name, "': shape does not match its ",
                       t.data.size(), " values"));
    }
    const uint64_t bytes = t.data.size() * sizeof(float);
    header[name] = {{"dtype", "F32"},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string json = header.dump();
  while (json.size() % 8 != 0) json.push_back(' ');  // aligned data
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    const uint64_t n = json.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = (n >> (8 * i)) & 0xFF;
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(json.data(), json.size());
    for (const auto& [name, t] : file.tensors) {
      out.write(reinterpret_cast<const char*>(t.data.data()),
                t.data.size() * sizeof(float));
    }
    out.flush();
    if (!out) {
      unlink(tmp.c_str());
      return absl::UnavailableError(
          absl::StrCat("cannot write state file '", tmp, "'"));
    }
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = strerror(errno);
    unlink(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot rename state file to '", path, "': ", why));
  }
  return int64_t(8 + json.size() + offset);
}

absl::StatusOr<SafetensorsFile> ReadSafetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open state file '", path, "'"));
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string bytes = buffer.str();
  auto bad = [&path](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("state file '", path, "': ", why));
  };
  if (bytes.size() < 8) return bad("shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  if (n > bytes.size() - 8) return bad("header length runs past the file");
  nlohmann::json header =
      nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + n, nullptr,
                            /*allow_exceptions=*/false);
  if (!header.is_object()) return bad("header is not a JSON object");
  const uint64_t data_start = 8 + n;
  const uint64_t data_size = bytes.size() - data_start;
  SafetensorsFile file;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return bad("__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) return bad("__metadata__ values must be strings");
        file.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const nlohmann::json& t = *it;
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets") || !t["shape"].is_array() ||
        !t["data_offsets"].is_array() || t["data_offsets"].size() != 2) {
      return bad(absl::StrCat("tensor '", it.key(), "' entry is malformed"));
    }
    if (t["dtype"] != "F32") {
      return bad(absl::StrCat("tensor '", it.key(), "' has dtype ",
                              t["dtype"].dump(), "; only F32 is supported"));
    }
    Fp32Tensor tensor;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return bad(absl::StrCat("tensor '", it.key(), "' has a bad shape"));
      }
      tensor.shape.push_back(d.get<int64_t>());
    }
    const uint64_t begin = t["data_offsets"][0].get<uint64_t>();
    const uint64_t end = t["data_offsets"][1].get<uint64_t>();
    if (begin > end || end > data_size ||
        (end - begin) != uint64_t(Numel(tensor.shape)) * sizeof(float)) {
      return bad(absl::StrCat("tensor '", it.key(),
                              "' data_offsets do not match its shape/file"));
    }
    tensor.data.resize((end - begin) / sizeof(float));
    memcpy(tensor.data.data(), bytes.data() + data_start + begin, end - begin);
    file.tensors[it.key()] = std::move(tensor);
  }
  return file;
}

}  // namespace muond
