#include "core/step/ns_homes_by_version.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace muond {

absl::Status NsHomesByVersion::Put(int64_t version, std::vector<NsHome> homes) {
  auto it = by_version_.find(version);
  if (it != by_version_.end()) {
    if (it->second == homes) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "homes version ", version,
        " was already set to different homes (versions name one plan)"));
  }
  by_version_.emplace(version, std::move(homes));
  while (by_version_.size() > kCapacity) by_version_.erase(by_version_.begin());
  return absl::OkStatus();
}

const std::vector<NsHome>* NsHomesByVersion::Find(int64_t version) const {
  auto it = by_version_.find(version);
  return it == by_version_.end() ? nullptr : &it->second;
}

int64_t NsHomesByVersion::newest() const {
  return by_version_.empty() ? 0 : by_version_.rbegin()->first;
}

int64_t NsHomesByVersion::oldest() const {
  return by_version_.empty() ? 0 : by_version_.begin()->first;
}

}  // namespace muond
