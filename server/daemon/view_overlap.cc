#include "server/daemon/view_overlap.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/common/dtype.h"
#include "core/common/echo.h"

namespace muond {
namespace {

struct Interval {
  uintptr_t begin;
  uintptr_t end;  // one past the last byte
  uint32_t span;  // index into the spans
};

bool ByBegin(const Interval& a, const Interval& b) {
  return a.begin < b.begin || (a.begin == b.begin && a.span < b.span);
}

std::string Label(const TensorSpan& s) {
  return absl::StrCat("param '", Echo(*s.param), "' ",
                      s.grad ? "grad" : "param");
}

absl::Status Overlap(const TensorSpan& a, const TensorSpan& b) {
  return absl::InvalidArgumentError(absl::StrCat(
      Label(a), " and ", Label(b),
      " overlap in memory: a param's memory must not overlap another "
      "param's or any grad's (it would be updated twice, or a grad "
      "overwritten while it is read); only grads may share memory"));
}

// [begin, end) of the whole view, first element to one past the last.
Interval Bounds(const TensorSpan& s, uint32_t index) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(s.view->data);
  return {begin, begin + uintptr_t(s.view->span_bytes()), index};
}

// One interval per row of a strided view, one for a contiguous one.
void AppendRows(const TensorSpan& s, uint32_t index,
                std::vector<Interval>& out) {
  const MatrixView& v = *s.view;
  if (v.contiguous()) {
    out.push_back(Bounds(s, index));
    return;
  }
  const uintptr_t es = DTypeSize(v.dtype);
  const uintptr_t base = reinterpret_cast<uintptr_t>(v.data);
  for (int64_t r = 0; r < v.rows; ++r) {
    const uintptr_t begin = base + uintptr_t(r * v.row_stride) * es;
    out.push_back({begin, begin + uintptr_t(v.cols) * es, index});
  }
}

// Sorted intervals: a param may overlap nothing, a grad no param.
absl::Status SweepRows(const std::vector<TensorSpan>& spans,
                       const std::vector<Interval>& rows) {
  const Interval* reach_any = nullptr;    // the interval ending last so far
  const Interval* reach_param = nullptr;  // the param interval ending last
  for (const Interval& x : rows) {
    const bool param = !spans[x.span].grad;
    const Interval* hit = param ? reach_any : reach_param;
    if (hit != nullptr && hit->end > x.begin) {
      return Overlap(spans[hit->span], spans[x.span]);
    }
    if (reach_any == nullptr || x.end > reach_any->end) reach_any = &x;
    if (param && (reach_param == nullptr || x.end > reach_param->end)) {
      reach_param = &x;
    }
  }
  return absl::OkStatus();
}

// A cluster of views whose bounding ranges chain-overlap: compared row by
// row (interleaved column blocks do not overlap even though their bounds
// do).
absl::Status CheckCluster(const std::vector<TensorSpan>& spans,
                          const Interval* first, const Interval* last) {
  if (std::all_of(first, last,
                  [&](const Interval& i) { return spans[i.span].grad; })) {
    return absl::OkStatus();  // grads only: read-only, may share memory
  }
  int64_t rows = 0;
  for (const Interval* i = first; i != last; ++i) {
    const MatrixView& v = *spans[i->span].view;
    rows += v.contiguous() ? 1 : v.rows;
  }
  if (rows > kMaxInterleavedRows) {
    return absl::InvalidArgumentError(absl::StrCat(
        Label(spans[first->span]), " and ", Label(spans[(first + 1)->span]),
        " and the views interleaved with them span ", rows,
        " strided rows; at most ", kMaxInterleavedRows,
        " are checked for overlap (use contiguous views or separate "
        "buffers)"));
  }
  std::vector<Interval> expanded;
  expanded.reserve(rows);
  for (const Interval* i = first; i != last; ++i) {
    AppendRows(spans[i->span], i->span, expanded);
  }
  std::sort(expanded.begin(), expanded.end(), ByBegin);
  return SweepRows(spans, expanded);
}

}  // namespace

absl::Status CheckNoAliasing(const std::vector<TensorSpan>& spans) {
  std::vector<Interval> bounds;
  bounds.reserve(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    // An empty view (a 0-row shard) holds no byte, so it overlaps nothing,
    // wherever its address falls.
    if (spans[i].view->numel() == 0) continue;
    bounds.push_back(Bounds(spans[i], uint32_t(i)));
  }
  std::sort(bounds.begin(), bounds.end(), ByBegin);
  for (size_t i = 0; i < bounds.size();) {
    size_t j = i + 1;
    uintptr_t end = bounds[i].end;
    while (j < bounds.size() && bounds[j].begin < end) {
      end = std::max(end, bounds[j].end);
      ++j;
    }
    if (j - i > 1) {
      if (absl::Status st =
              CheckCluster(spans, bounds.data() + i, bounds.data() + j);
          !st.ok()) {
        return st;
      }
    }
    i = j;
  }
  return absl::OkStatus();
}

}  // namespace muond
