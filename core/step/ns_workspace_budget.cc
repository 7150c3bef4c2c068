#include "core/step/ns_workspace_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace muond {

int64_t NsWorkspaceBudget::Reserve(const MemoryInfo& memory) {
  return std::max<int64_t>(int64_t(256) << 20, memory.total_bytes / 50);
}

absl::StatusOr<bool> NsWorkspaceBudget::TryTake(Backend& backend,
                                                int64_t bytes) {
  const absl::StatusOr<MemoryInfo> memory = backend.Memory();
  if (!memory.ok() && !absl::IsUnimplemented(memory.status())) {
    return memory.status();
  }
  absl::MutexLock lock(&mu_);
  if (cap_ > 0 && taken_ + bytes > cap_) return false;
  if (memory.ok() && bytes > memory->free_bytes - Reserve(*memory)) {
    return false;
  }
  taken_ += bytes;
  peak_ = std::max(peak_, taken_);
  return true;
}

void NsWorkspaceBudget::Give(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  taken_ -= bytes;
}

int64_t NsWorkspaceBudget::taken() const {
  absl::MutexLock lock(&mu_);
  return taken_;
}

int64_t NsWorkspaceBudget::peak() const {
  absl::MutexLock lock(&mu_);
  return peak_;
}

std::string NsWorkspaceBudget::Describe(Backend& backend, int64_t bytes) const {
  std::string free = "free memory unknown";
  if (const absl::StatusOr<MemoryInfo> m = backend.Memory(); m.ok()) {
    free = absl::StrCat(m->free_bytes, " of ", m->total_bytes, " bytes free (",
                        Reserve(*m), " kept in reserve)");
  }
  std::string out = absl::StrCat(bytes, " bytes needed; ", free, " on ",
                                 std::string(backend.name()));
  absl::StrAppend(&out, "; NS workspaces hold ", taken());
  if (cap_ > 0) absl::StrAppend(&out, " (cap ", cap_, ")");
  return out;
}

}  // namespace muond
