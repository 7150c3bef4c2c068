#pragma once
// Newton–Schulz (+ its scale) on a list of matrices of one group, batched by
// shape up to NsBatchLimit (ns_batch_rule.h), with the group's NewtonSchulz
// engines cached by (rows, cols, batch) and per-shape wall times for the
// coordinator's rebalancing (docs/ARCHITECTURE.md "One step"). Unmeasured
// runs go through Backend::RunGraph: on CUDA the whole NS work of a Run is
// one graph replay (docs/ARCHITECTURE.md "CUDA graphs").
#include <cstdint>
#include <deque>
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
#include "core/step/ns_workspace_budget.h"
#include "core/step/step_result.h"

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

// One runner serves every group of a lane on one backend and work dtype
// (LayerShardedMuonImpl::SetUpLanes): the lane runs its groups one after the
// other, so they share the engines and their workspaces (per NS options,
// shape and batch) instead of each group holding its own, which per-layer
// groups would multiply by the layer count. Not thread-safe.
class NsRunner {
 public:
  // `backend` (the group's, not owned) runs NS on `work_dtype` matrices
  // (NsWorkDType of the group's precision).
  NsRunner() : id_(NextId()) {}
  // `budget` (not owned; null: none) bounds the engines' workspaces: a batch
  // whose workspace does not fit is halved until it does (Plan).
  NsRunner(Backend* backend, DType work_dtype,
           NsWorkspaceBudget* budget = nullptr)
      : backend_(backend),
        work_dtype_(work_dtype),
        budget_(budget),
        id_(NextId()) {}
  NsRunner(NsRunner&& other) noexcept { *this = std::move(other); }
  NsRunner& operator=(NsRunner&& other) noexcept;
  // Gives the workspaces' bytes back to the budget.
  ~NsRunner();

  // Orthogonalizes every matrix of `matrices` in place (NS + scale); the
  // views are in the work dtype, each result is written over its input in
  // NsResultDType of its shape (fp16 for Gram NS under kMedium: the same
  // 2 bytes per element as the bf16 input).
  // Same-shape matrices are chunked in list order up to
  // NsBatchLimit(options.ns_batch_size, ...), or the largest batch (halving)
  // whose workspace the budget grants at the shape's first Run, kept for
  // every later Run; only a shape of which not even one matrix fits fails
  // (ResourceExhausted with the numbers). So chunking depends on the param
  // order and, past the budget, on this rank's memory (only the NS home runs
  // a matrix's NS); a chunk of one runs unbatched (the bit-exact numerics
  // contract), a chunk
  // lying back to back in memory (AllocateSlabs) runs batched in place, any
  // other chunk is staged through a buffer kept for the next step. `times`:
  // null, or where each chunk's wall time goes (the backend is synchronised
  // after each chunk, so a measured step costs one host sync per chunk).
  // With `times` null (and graphs on) the chunks run as one
  // Backend::RunGraph under GraphKey: on CUDA, one graph replay per Run after
  // the first (same results bitwise: a replay launches the same kernels).
  absl::Status Run(const MuonOptions& options,
                   absl::Span<const MatrixView> matrices, ShapeTimes* times);
  // Run on each list in turn (each chunked on its own, exactly as by Run),
  // unmeasured as one RunGraph for all of them: a step's NS phase is one
  // graph replay.
  absl::Status RunLists(const MuonOptions& options,
                        absl::Span<const absl::Span<const MatrixView>> lists,
                        ShapeTimes* times);

  // The chunks Run(options, matrices) runs, in its order, each as the
  // positions of its members in `matrices` (planned as Run plans them: the
  // engines are created). A sublist made of whole chunks in this order runs
  // as the same chunks, so NS can start on the first matrices while later
  // ones are still being written (streamed host state, group_step.cc).
  absl::StatusOr<std::vector<std::vector<size_t>>> ChunksOf(
      const MuonOptions& options, absl::Span<const MatrixView> matrices);

  // Graphs on (the default) or off (every Run enqueues its calls one by one,
  // as a measured Run does); for tests and A/B runs. The backend has its own
  // switch (CudaBackendOptions::cuda_graphs).
  void set_use_graphs(bool use) { use_graphs_ = use; }

 private:
  // One batch of same-shape matrices and how it runs.
  enum class ChunkKind { kSingle, kStacked, kStaged };
  struct Chunk {
    NewtonSchulz* ns;
    int64_t rows, cols;
    absl::Span<const MatrixView> members;
    ChunkKind kind;
  };
  // Groups each list's matrices into chunks, creating every engine and the
  // staging buffer they need, so that running the chunks allocates nothing
  // (a graph capture must not allocate). `members` owns the views the
  // chunks span (a deque: they stay put as it grows). `ns_key`:
  // NsOptionsKey(options), hashed once per Run.
  absl::StatusOr<std::vector<Chunk>> Plan(
      const MuonOptions& options, uint64_t ns_key,
      absl::Span<const absl::Span<const MatrixView>> lists,
      std::deque<std::vector<MatrixView>>& members);
  absl::Status RunChunk(const Chunk& chunk);
  // Everything a replay of the chunks bakes in: this runner (its engines'
  // workspaces live as long as it does), the NS options, each chunk's
  // engine, kind and views (pointer, shape, stride, dtype), and the staging
  // buffer.
  uint64_t GraphKey(const MuonOptions& options, uint64_t ns_key,
                    const std::vector<Chunk>& chunks) const;
  static uint64_t NextId();
  // The NS options an engine is built with (NewtonSchulz::Create): groups
  // sharing a runner may differ in them.
  static uint64_t NsOptionsKey(const MuonOptions& options);

  absl::StatusOr<NewtonSchulz*> GetNs(const MuonOptions& options,
                                      uint64_t ns_key, int64_t rows,
                                      int64_t cols, int64_t batch);
  // The batch (<= want) of rows x cols matrices to run together: one with an
  // engine already, else the largest halving of `want` whose workspace (and
  // staging, unless `stacked`) the budget grants, taken from it.
  absl::StatusOr<int64_t> FitBatch(const MuonOptions& options, uint64_t ns_key,
                                   int64_t rows, int64_t cols, int64_t want,
                                   bool stacked);
  // Whether `chunk` lies back to back in memory as one stacked matrix.
  bool IsStacked(absl::Span<const MatrixView> chunk) const;
  // Runs one chunk of `batch` same-shape matrices through the staging buffer
  // (sized by Plan).
  absl::Status RunStaged(NewtonSchulz& ns, absl::Span<const MatrixView> chunk);
  absl::Status RecordTime(ShapeTimes* times, int64_t rows, int64_t cols,
                          int64_t count, absl::Time start);

  Backend* backend_ = nullptr;
  DType work_dtype_ = DType::kFloat32;
  NsWorkspaceBudget* budget_ = nullptr;
  // Bytes this runner took from the budget.
  int64_t taken_ = 0;
  // Per NS options, batch limit and shape, the batch the budget cut it to
  // (FitBatch); absent: the limit (NsBatchLimit).
  using ShapeKey = std::tuple<uint64_t, int64_t, int64_t, int64_t>;
  std::map<ShapeKey, int64_t> batch_of_shape_;
  // Per NS options, shape and batch.
  using EngineKey = std::tuple<uint64_t, int64_t, int64_t, int64_t>;
  std::map<EngineKey, std::unique_ptr<NewtonSchulz>> engines_;
  // Staging for chunks that are not back to back.
  OwnedBuffer staging_;
  int64_t staging_elems_ = 0;
  // The staging elements charged to the budget: the largest staged batch
  // FitBatch granted (the buffer grows to it before the chunks run).
  int64_t staging_charged_elems_ = 0;
  bool use_graphs_ = true;
  // Unique per runner in the process: graph keys of a runner never match
  // those of a later one that reuses freed addresses.
  uint64_t id_ = 0;
};

}  // namespace muond
