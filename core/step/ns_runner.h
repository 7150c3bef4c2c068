#pragma once
// Newton–Schulz (+ its scale) on a list of matrices of one group, batched by
// shape up to MuonOptions::ns_batch_size, with the group's NewtonSchulz
// engines cached by (rows, cols, batch) and per-shape wall times for the
// coordinator's rebalancing (docs/ARCHITECTURE.md "One step").
#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "core/backend/backend.h"
#include "core/common/matrix_view.h"
#include "core/muon/muon_update.h"
#include "core/muon/newton_schulz.h"
#include "core/step/buffers.h"
#include "core/step/layer_sharded_muon.h"

namespace muond {

// The per-shape NS times of one step, shared by the lanes running at once.
class ShapeTimes {
 public:
  // Adds `count` NS runs of rows x cols that took `us` microseconds.
  void Add(int64_t rows, int64_t cols, int64_t count, double us);
  // By (rows, cols) ascending.
  std::vector<ShapeTiming> ByShape() const;
  void Clear();

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<int64_t, int64_t>, ShapeTiming> times_
      ABSL_GUARDED_BY(mu_);
};

class NsRunner {
 public:
  // `backend` (the group's, not owned) runs NS on `work_dtype` matrices
  // (NsWorkDType of the group's precision).
  NsRunner() = default;
  NsRunner(Backend* backend, DType work_dtype)
      : backend_(backend), work_dtype_(work_dtype) {}

  // Orthogonalizes every matrix of `matrices` in place (NS + scale).
  // Same-shape matrices are chunked in list order (so chunking depends only
  // on the rank-independent param order) up to options.ns_batch_size; a
  // chunk of one runs unbatched (the bit-exact numerics contract), a chunk
  // lying back to back in memory (AllocateSlabs) runs batched in place, any
  // other chunk is staged through a buffer kept for the next step. `times`:
  // null, or where each chunk's wall time goes (the backend is synchronised
  // after each chunk, so a measured step costs one host sync per chunk).
  absl::Status Run(const MuonOptions& options,
                   absl::Span<const MatrixView> matrices, ShapeTimes* times);

 private:
  absl::StatusOr<NewtonSchulz*> GetNs(const MuonOptions& options, int64_t rows,
                                      int64_t cols, int64_t batch);
  // Whether `chunk` lies back to back in memory as one stacked matrix.
  bool IsStacked(absl::Span<const MatrixView> chunk) const;
  // Runs one chunk of `batch` same-shape matrices through the staging buffer.
  absl::Status RunStaged(NewtonSchulz& ns, absl::Span<const MatrixView> chunk);
  absl::Status RecordTime(ShapeTimes* times, int64_t rows, int64_t cols,
                          int64_t count, absl::Time start);

  Backend* backend_ = nullptr;
  DType work_dtype_ = DType::kFloat32;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<NewtonSchulz>>
      engines_;
  // Staging for chunks that are not back to back.
  OwnedBuffer staging_;
  int64_t staging_elems_ = 0;
};

}  // namespace muond
