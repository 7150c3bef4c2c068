#include "server/daemon/state_file.h"

#include <cmath>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"

namespace muond {
namespace {

// Where an engine state name's tensor goes in the file.
struct KeyTarget {
  std::string file_prefix;  // "<engine prefix>/g<g>t<t>/"
  const std::vector<int64_t>* local_shape;
};

// Engine prefix ("<group>/<param>", and "<param>" alone) -> target, built once
// per save/load so mapping each entry is one lookup (a scan of every param
// per entry made 100 000 params take minutes).
class StateKeys {
 public:
  explicit StateKeys(const Registration& reg) {
    for (const BoundGroup& g : reg.groups) {
      const std::string coords = absl::StrCat("/g", g.proto.domain().g(), "t",
                                              g.proto.domain().t(), "/");
      for (const BoundParam& p : g.params) {
        const std::string grouped = absl::StrCat(g.proto.name(), "/", p.name);
        targets_[grouped] = {grouped + coords, &p.local_shape};
        targets_.emplace(p.name, KeyTarget{p.name + coords, &p.local_shape});
        if (g.proto.algorithm() == v1::ALGORITHM_ADAMW) {
          group_counts_[grouped + ".step"] = g.proto.name() + "/.step";
        }
      }
    }
  }

  // The key of the group's one step count files written before counts were
  // per param ("<group>/.step") for the engine's per-param count `name`
  // ("<group>/<param>.step"); null when `name` is none.
  const std::string* OldGroupCount(const std::string& name) const {
    auto it = group_counts_.find(name);
    return it == group_counts_.end() ? nullptr : &it->second;
  }

  // The file key and shape of engine entry `name` with `size` values.
  std::pair<std::string, std::vector<int64_t>> Map(const std::string& name,
                                                   size_t size) const {
    // Suffixes (momentum, exp_avg, exp_avg_sq) have no '.', param names may.
    const size_t dot = name.rfind('.');
    if (dot != std::string::npos && dot > 0 && dot + 1 < name.size()) {
      auto it = targets_.find(name.substr(0, dot));
      if (it != targets_.end()) {
        std::vector<int64_t> shape = {int64_t(size)};
        int64_t numel = 1;
        for (int64_t d : *it->second.local_shape) numel *= d;
        if (numel == int64_t(size)) shape = *it->second.local_shape;
        return {it->second.file_prefix + name.substr(dot + 1),
                std::move(shape)};
      }
    }
    return {name, {int64_t(size)}};
  }

 private:
  std::unordered_map<std::string, KeyTarget> targets_;
  std::unordered_map<std::string, std::string> group_counts_;
};

// JSON of each group's domain and hyperparameters, for the file's metadata
// (informational: load checks tensors, so a file saved under other
// hyperparameters still loads).
std::string DomainsJson(const Registration& reg) {
  nlohmann::json out = nlohmann::json::object();
  for (const BoundGroup& g : reg.groups) {
    const v1::Domain& d = g.proto.domain();
    out[g.proto.name()] = {{"name", d.name()},
                           {"gtp_size", d.gtp_size()},
                           {"tp_size", d.tp_size()},
                           {"g", d.g()},
                           {"t", d.t()}};
  }
  return out.dump();
}

std::string HyperparametersJson(const Registration& reg) {
  nlohmann::json out = nlohmann::json::object();
  for (const BoundGroup& g : reg.groups) {
    const bool adamw = g.proto.algorithm() == v1::ALGORITHM_ADAMW;
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    options.preserve_proto_field_names = true;
    if (adamw) {
      (void)google::protobuf::util::MessageToJsonString(g.proto.adamw(), &json,
                                                        options);
    } else {
      (void)google::protobuf::util::MessageToJsonString(g.proto.muon(), &json,
                                                        options);
    }
    nlohmann::json h = nlohmann::json::parse(json, nullptr, false);
    out[g.proto.name()] = {{"algorithm", adamw ? "adamw" : "muon"},
                           {adamw ? "adamw" : "muon", h}};
  }
  return out.dump();
}

absl::Status Bad(const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("state file '", path, "': ", why));
}

absl::StatusOr<int64_t> FileStepId(const std::string& path,
                                   const std::map<std::string, std::string>& m,
                                   int64_t max_step_id) {
  auto it = m.find("step_id");
  int64_t step_id = 0;
  if (it == m.end() || !absl::SimpleAtoi(it->second, &step_id) ||
      step_id < -1 || step_id > max_step_id) {
    return Bad(
        path, absl::StrCat(
                  "metadata 'step_id' must be an integer in [-1, ", max_step_id,
                  "], not '",
                  it == m.end() ? "(missing)" : it->second.substr(0, 32), "'"));
  }
  return step_id;
}

}  // namespace

// Finite values (a NaN momentum would turn every param NaN at the next step),
// exp_avg_sq >= 0 (its square root divides), step counts integral in range.
absl::Status CheckStateValues(const std::string& where, const std::string& name,
                              const std::string& key,
                              const std::vector<float>& values) {
  const auto Bad = [&where](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", why));
  };
  // AdamW's and the Muon variants' second moments.
  const bool second_moment = absl::EndsWith(name, ".exp_avg_sq") ||
                             absl::EndsWith(name, ".variance_neuron") ||
                             absl::EndsWith(name, ".moment2");
  // AdamW step counts: "<group>/<param>.step" (and a file's old
  // "<group>/.step"); no tensor entry ends so.
  const bool count = absl::EndsWith(name, ".step");
  for (size_t i = 0; i < values.size(); ++i) {
    const float v = values[i];
    if (!std::isfinite(v)) {
      return Bad(absl::StrCat("tensor '", key,
                              "' has the non-finite "
                              "value ",
                              v, " at index ", i));
    }
    if (second_moment && v < 0) {
      return Bad(absl::StrCat("tensor '", key, "' (",
                              name.substr(name.rfind('.') + 1),
                              ") has the "
                              "negative value ",
                              v, " at index ", i));
    }
    if (count && (v < 0 || v != std::floor(v) ||
                  double(v) >= double(kMaxAdamWStepCount))) {
      return Bad(absl::StrCat("tensor '", key,
                              "' (AdamW step count) "
                              "is ",
                              v,
                              "; it must be an integer in "
                              "[0, 2^62)"));
    }
  }
  return absl::OkStatus();
}

SafetensorsFile StateToFile(const Registration& reg, StateTensors state,
                            const StateFileInfo& info) {
  const StateKeys keys(reg);
  SafetensorsFile file;
  file.metadata["format"] = "muond-state-v1";
  file.metadata["job_id"] = info.job_id;
  file.metadata["rank"] = absl::StrCat(info.rank);
  file.metadata["step_id"] = absl::StrCat(info.step_id);
  file.metadata["plan_version"] = absl::StrCat(info.plan_version);
  file.metadata["domains"] = DomainsJson(reg);
  file.metadata["hyperparameters"] = HyperparametersJson(reg);
  for (auto& [name, values] : state) {
    auto [key, shape] = keys.Map(name, values.size());
    file.tensors[std::move(key)] =
        Fp32Tensor{std::move(shape), std::move(values)};
  }
  return file;
}

absl::StatusOr<LoadedState> StateFromFile(const std::string& path,
                                          SafetensorsFile file,
                                          const Registration& reg,
                                          const StateTensors& current,
                                          const std::string& job_id,
                                          int64_t max_step_id) {
  auto job = file.metadata.find("job_id");
  if (job == file.metadata.end() || job->second != job_id) {
    return Bad(path, absl::StrCat("is of job '",
                                  job == file.metadata.end()
                                      ? "(missing)"
                                      : job->second.substr(0, 128),
                                  "', not '", job_id, "'"));
  }
  LoadedState out;
  absl::StatusOr<int64_t> step_id =
      FileStepId(path, file.metadata, max_step_id);
  if (!step_id.ok()) return step_id.status();
  out.step_id = *step_id;
  const StateKeys keys(reg);
  std::unordered_set<std::string> used;
  for (const auto& [name, values] : current) {
    auto [key, want] = keys.Map(name, values.size());
    auto it = file.tensors.find(key);
    const std::string* old_count = keys.OldGroupCount(name);
    if (it == file.tensors.end() && old_count != nullptr) {
      // A file of one count per group: every param of the group gets it.
      it = file.tensors.find(*old_count);
      if (it != file.tensors.end() && it->second.data.size() == 1) {
        key = *old_count;
        if (absl::Status st =
                CheckStateValues(absl::StrCat("state file '", path, "'"),
                                 *old_count, key, it->second.data);
            !st.ok()) {
          return st;
        }
        out.state[name] = it->second.data;  // copied: the group's others too
        used.insert(key);
        continue;
      }
    }
    if (it == file.tensors.end()) {
      return Bad(path, absl::StrCat("lacks tensor '", key, "'"));
    }
    if (it->second.shape != want || it->second.data.size() != values.size()) {
      return Bad(path, absl::StrCat("tensor '", key, "' has shape [",
                                    absl::StrJoin(it->second.shape, ", "),
                                    "], the registered shard needs [",
                                    absl::StrJoin(want, ", "), "]"));
    }
    if (absl::Status st =
            CheckStateValues(absl::StrCat("state file '", path, "'"), name, key,
                             it->second.data);
        !st.ok()) {
      return st;
    }
    out.state[name] = std::move(it->second.data);
    used.insert(key);
  }
  for (const auto& [key, t] : file.tensors) {
    if (!used.contains(key)) {
      return Bad(path,
                 absl::StrCat("has tensor '", key.substr(0, 128),
                              "' that no registered param of this rank owns"));
    }
  }
  return out;
}

}  // namespace muond
