#include "core/plan/manifest.h"

#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/common/error_reason.h"
#include "nlohmann/json.hpp"

namespace muond {
namespace {

using nlohmann::json;

absl::Status EntryError(size_t index, const std::string& name,
                        const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat(
      "manifest entry ", index,
      name.empty() ? "" : absl::StrCat(" (param '", name, "')"), ": ", rule));
}

absl::StatusOr<ManifestParam> ParseEntry(const json& e, size_t index) {
  ManifestParam p;
  if (!e.is_object()) return EntryError(index, "", "is not an object");
  if (!e.contains("name") || !e["name"].is_string()) {
    return EntryError(index, "", "needs a string 'name'");
  }
  p.name = e["name"].get<std::string>();
  if (!e.contains("shape") || !e["shape"].is_array()) {
    return EntryError(index, p.name, "needs an array 'shape'");
  }
  for (const json& d : e["shape"]) {
    if (!d.is_number_integer()) {
      return EntryError(index, p.name, "'shape' must hold integers");
    }
    p.shape.push_back(d.get<int64_t>());
  }
  if (e.contains("tp_dim") && !e["tp_dim"].is_null()) {
    if (!e["tp_dim"].is_number_integer()) {
      return EntryError(index, p.name, "'tp_dim' must be 0, 1, -1 or null");
    }
    p.tp_dim = e["tp_dim"].get<int>();
  }
  if (e.contains("gtp_sharded")) {
    if (!e["gtp_sharded"].is_boolean()) {
      return EntryError(index, p.name, "'gtp_sharded' must be a boolean");
    }
    p.gtp_sharded = e["gtp_sharded"].get<bool>();
  }
  if (e.contains("pad_length") && !e["pad_length"].is_null()) {
    if (!e["pad_length"].is_number_integer() ||
        e["pad_length"].get<int64_t>() < 0) {
      return EntryError(index, p.name,
                        "'pad_length' must be an integer >= 0 or null");
    }
    p.pad_length = e["pad_length"].get<int64_t>();
  }
  return p;
}

}  // namespace

absl::StatusOr<Manifest> ParseManifest(std::string_view json_text) {
  json doc = json::parse(json_text.begin(), json_text.end(), nullptr,
                         /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError("manifest is not valid JSON");
  }
  Manifest m;
  const json* list = &doc;
  if (doc.is_object()) {
    if (doc.contains("model") && doc["model"].is_string()) {
      m.model = doc["model"].get<std::string>();
    }
    if (!doc.contains("params")) {
      return absl::InvalidArgumentError("manifest object has no 'params'");
    }
    list = &doc["params"];
  }
  if (!list->is_array()) {
    return absl::InvalidArgumentError("manifest params are not a list");
  }
  m.params.reserve(list->size());
  for (size_t i = 0; i < list->size(); ++i) {
    absl::StatusOr<ManifestParam> p = ParseEntry((*list)[i], i);
    if (!p.ok()) return p.status();
    m.params.push_back(*std::move(p));
  }
  return m;
}

absl::StatusOr<Manifest> LoadManifestFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open manifest ", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<Manifest> m = ParseManifest(text.str());
  if (!m.ok()) {
    return WithContext(m.status(), absl::StrCat(path, ": "));
  }
  return m;
}

absl::StatusOr<std::vector<ParamShardSpec>> ManifestSpecs(
    const Manifest& manifest, DomainSize domain) {
  std::vector<ParamShardSpec> specs;
  specs.reserve(manifest.params.size());
  for (const ManifestParam& p : manifest.params) {
    absl::StatusOr<ParamShardSpec> spec = MakeShardSpecFromFullShape(
        p.name, p.shape, p.tp_dim, p.gtp_sharded, p.pad_length, domain);
    if (!spec.ok()) return spec.status();
    specs.push_back(*std::move(spec));
  }
  return specs;
}

}  // namespace muond
