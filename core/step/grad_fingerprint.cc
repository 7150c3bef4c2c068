#include "core/step/grad_fingerprint.h"

#include "core/common/dtype.h"
#include "core/step/domain_agreement.h"

namespace muond {

uint64_t GradFingerprint(const GroupState& group,
                         const std::set<std::string>& skip) {
  const DomainBinding& domain = group.config.domain;
  if (domain.dp == nullptr || domain.dp->size() <= 1 ||
      group.backend->is_device()) {
    return 0;
  }
  Fingerprint f;
  for (const ParamBinding& p : group.config.params) {
    if (skip.contains(p.name)) continue;
    const MatrixView& g = p.grad;
    const size_t elem = DTypeSize(g.dtype);
    for (int64_t r = 0; r < g.rows; ++r) {
      f.Add(static_cast<const char*>(g.data) + r * g.row_stride * elem,
            size_t(g.cols) * elem);
    }
    f.AddWord(uint64_t(1) << 63);  // where one param ends
  }
  // 0 means "none taken"; a real fingerprint of 0 is moved off it.
  return f.value() == 0 ? 1 : f.value();
}

}  // namespace muond
