#include "core/step/ns_runner.h"

#include <algorithm>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/status_macros.h"

namespace muond {

void ShapeTimes::Add(int64_t rows, int64_t cols, int64_t count, double us) {
  absl::MutexLock lock(&mu_);
  ShapeTiming& t = times_[{rows, cols}];
  t.rows = rows;
  t.cols = cols;
  t.ns_us += us;
  t.count += count;
}

std::vector<ShapeTiming> ShapeTimes::ByShape() const {
  absl::MutexLock lock(&mu_);
  std::vector<ShapeTiming> out;
  for (const auto& [shape, timing] : times_) out.push_back(timing);
  return out;
}

void ShapeTimes::Clear() {
  absl::MutexLock lock(&mu_);
  times_.clear();
}

absl::Status NsRunner::Run(const MuonOptions& options,
                           absl::Span<const MatrixView> matrices,
                           ShapeTimes* times) {
  // Same-shape matrices in first-appearance order.
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::vector<MatrixView>>>
      by_shape;
  for (const MatrixView& m : matrices) {
    auto shape = std::make_pair(m.rows, m.cols);
    auto it = std::find_if(by_shape.begin(), by_shape.end(),
                           [&](const auto& e) { return e.first == shape; });
    if (it == by_shape.end()) {
      by_shape.push_back({shape, {m}});
    } else {
      it->second.push_back(m);
    }
  }
  const int64_t max_batch = std::max<int64_t>(1, options.ns_batch_size);
  for (const auto& [shape, members] : by_shape) {
    const auto [rows, cols] = shape;
    for (size_t begin = 0; begin < members.size(); begin += max_batch) {
      const int64_t batch =
          std::min<int64_t>(max_batch, int64_t(members.size()) - begin);
      const absl::Span<const MatrixView> chunk =
          absl::MakeConstSpan(members).subspan(begin, batch);
      ASSIGN_OR_RETURN(NewtonSchulz * ns, GetNs(options, rows, cols, batch));
      const absl::Time chunk_start = absl::Now();
      if (batch == 1) {
        // The unbatched path, in place: bit-exact numerics contract.
        RETURN_IF_ERROR(ns->Run(chunk[0], chunk[0], 1));
      } else if (IsStacked(chunk)) {
        const MatrixView stacked =
            ContiguousView(chunk[0].data, work_dtype_, batch * rows, cols);
        RETURN_IF_ERROR(ns->Run(stacked, stacked, batch));
      } else {
        RETURN_IF_ERROR(RunStaged(*ns, chunk));
      }
      RETURN_IF_ERROR(RecordTime(times, rows, cols, batch, chunk_start));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<NewtonSchulz*> NsRunner::GetNs(const MuonOptions& options,
                                              int64_t rows, int64_t cols,
                                              int64_t batch) {
  auto key = std::make_tuple(rows, cols, batch);
  auto it = engines_.find(key);
  if (it != engines_.end()) return it->second.get();
  ASSIGN_OR_RETURN(
      auto ns, NewtonSchulz::Create(backend_, options.ns, rows, cols, batch));
  NewtonSchulz* raw = ns.get();
  engines_.emplace(key, std::move(ns));
  return raw;
}

bool NsRunner::IsStacked(absl::Span<const MatrixView> chunk) const {
  const MatrixView& first = chunk[0];
  if (first.dtype != work_dtype_) return false;
  const int64_t bytes =
      first.rows * first.cols * int64_t(DTypeSize(work_dtype_));
  for (size_t b = 0; b < chunk.size(); ++b) {
    const MatrixView& m = chunk[b];
    const bool packed = m.rows <= 1 || m.row_stride == first.cols;
    if (!packed || m.data != static_cast<char*>(first.data) + b * bytes) {
      return false;
    }
  }
  return true;
}

absl::Status NsRunner::RunStaged(NewtonSchulz& ns,
                                 absl::Span<const MatrixView> chunk) {
  const int64_t batch = int64_t(chunk.size());
  const int64_t rows = chunk[0].rows, cols = chunk[0].cols;
  const int64_t elems = batch * rows * cols;
  if (elems > staging_elems_) {
    ASSIGN_OR_RETURN(staging_, AllocateZeroed(backend_, work_dtype_, 1, elems));
    staging_elems_ = elems;
  }
  const MatrixView stacked =
      ContiguousView(staging_.data(), work_dtype_, batch * rows, cols);
  for (int64_t b = 0; b < batch; ++b) {
    RETURN_IF_ERROR(
        backend_->Copy2D(stacked.Block(b * rows, 0, rows, cols), chunk[b]));
  }
  RETURN_IF_ERROR(ns.Run(stacked, stacked, batch));
  for (int64_t b = 0; b < batch; ++b) {
    RETURN_IF_ERROR(
        backend_->Copy2D(chunk[b], stacked.Block(b * rows, 0, rows, cols)));
  }
  return absl::OkStatus();
}

absl::Status NsRunner::RecordTime(ShapeTimes* times, int64_t rows, int64_t cols,
                                  int64_t count, absl::Time start) {
  if (times == nullptr) return absl::OkStatus();
  // The chunk's work must have finished (device backends run async).
  RETURN_IF_ERROR(backend_->Synchronize());
  times->Add(rows, cols, count,
             absl::ToDoubleMicroseconds(absl::Now() - start));
  return absl::OkStatus();
}

}  // namespace muond
