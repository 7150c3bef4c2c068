#include "core/step/ns_runner.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/common/status_macros.h"
#include "core/step/ns_batch_rule.h"
#include "glog/logging.h"

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

namespace {

// 64-bit FNV-1a over words, with a final avalanche: the graph key of a run.
class KeyHasher {
 public:
  void Add(uint64_t word) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= (word >> (8 * i)) & 0xffu;
      h_ *= 0x100000001b3ull;
    }
  }
  void Add(const void* p) { Add(uint64_t(reinterpret_cast<uintptr_t>(p))); }
  void Add(double x) {
    uint64_t u;
    std::memcpy(&u, &x, sizeof(u));
    Add(u);
  }
  void Add(const MatrixView& v) {
    Add(v.data);
    Add(uint64_t(v.dtype));
    Add(uint64_t(v.rows));
    Add(uint64_t(v.cols));
    Add(uint64_t(v.row_stride));
  }
  uint64_t Finish() const {
    uint64_t z = h_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

// Every NsOptions field a run depends on.
void AddNsOptions(KeyHasher& h, const NsOptions& ns) {
  h.Add(uint64_t(ns.coefficient_type));
  h.Add(uint64_t(ns.custom.size()));
  for (const NsCoefficients& k : ns.custom) {
    h.Add(double(k.a));
    h.Add(double(k.b));
    h.Add(double(k.c));
  }
  h.Add(uint64_t(ns.num_steps));
  h.Add(double(ns.eps));
  h.Add(uint64_t(ns.precision));
  h.Add(uint64_t(ns.use_syrk));
  h.Add(uint64_t(ns.syrk_block_rows));
  h.Add(uint64_t(ns.algorithm));
  h.Add(uint64_t(ns.gram_restarts.has_value()));
  if (ns.gram_restarts.has_value()) {
    h.Add(uint64_t(ns.gram_restarts->size()));
    for (int r : *ns.gram_restarts) h.Add(uint64_t(r));
  }
  h.Add(uint64_t(ns.gram_dtype));
  h.Add(ns.gram_min_aspect_ratio);
}

}  // namespace

uint64_t NsRunner::NsOptionsKey(const MuonOptions& options) {
  KeyHasher h;
  AddNsOptions(h, options.ns);
  return h.Finish();
}

uint64_t NsRunner::NextId() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

absl::Status NsRunner::Run(const MuonOptions& options,
                           absl::Span<const MatrixView> matrices,
                           ShapeTimes* times) {
  const absl::Span<const MatrixView> lists[] = {matrices};
  return RunLists(options, lists, times);
}

absl::Status NsRunner::RunLists(
    const MuonOptions& options,
    absl::Span<const absl::Span<const MatrixView>> lists, ShapeTimes* times) {
  std::deque<std::vector<MatrixView>> members;
  const uint64_t ns_key = NsOptionsKey(options);
  ASSIGN_OR_RETURN(std::vector<Chunk> chunks,
                   Plan(options, ns_key, lists, members));
  if (chunks.empty()) return absl::OkStatus();
  if (times == nullptr && use_graphs_) {
    return backend_->RunGraph(GraphKey(options, ns_key, chunks),
                              [&]() -> absl::Status {
                                for (const Chunk& chunk : chunks)
                                  RETURN_IF_ERROR(RunChunk(chunk));
                                return absl::OkStatus();
                              });
  }
  // A measured chunk's time starts with the queue empty: the work issued
  // before it (phases no longer wait for theirs) is not its.
  if (times != nullptr) RETURN_IF_ERROR(backend_->Synchronize());
  for (const Chunk& chunk : chunks) {
    const absl::Time chunk_start = absl::Now();
    RETURN_IF_ERROR(RunChunk(chunk));
    RETURN_IF_ERROR(RecordTime(times, chunk.rows, chunk.cols,
                               int64_t(chunk.members.size()), chunk_start));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<size_t>>> NsRunner::ChunksOf(
    const MuonOptions& options, absl::Span<const MatrixView> matrices) {
  std::deque<std::vector<MatrixView>> members;
  const absl::Span<const MatrixView> lists[] = {matrices};
  ASSIGN_OR_RETURN(std::vector<Chunk> chunks,
                   Plan(options, NsOptionsKey(options), lists, members));
  // Positions by address, in list order (empty matrices may share one).
  std::map<const void*, std::deque<size_t>> positions;
  for (size_t i = 0; i < matrices.size(); ++i) {
    positions[matrices[i].data].push_back(i);
  }
  std::vector<std::vector<size_t>> out;
  for (const Chunk& chunk : chunks) {
    std::vector<size_t>& indices = out.emplace_back();
    for (const MatrixView& m : chunk.members) {
      std::deque<size_t>& at = positions[m.data];
      indices.push_back(at.front());
      at.pop_front();
    }
  }
  return out;
}

absl::StatusOr<std::vector<NsRunner::Chunk>> NsRunner::Plan(
    const MuonOptions& options, uint64_t ns_key,
    absl::Span<const absl::Span<const MatrixView>> lists,
    std::deque<std::vector<MatrixView>>& members) {
  // Measuring free memory and allocating must not interleave with another
  // lane's (host work only, short once the engines exist).
  std::optional<absl::MutexLock> building;
  if (budget_ != nullptr) building.emplace(&budget_->build_mutex());
  std::vector<Chunk> chunks;
  int64_t staging_elems = 0;
  const bool auto_on_device =
      options.ns_batch_size == 0 && backend_->is_device();
  for (const absl::Span<const MatrixView> matrices : lists) {
    // Same-shape matrices of this list in first-appearance order.
    std::vector<std::pair<int64_t, int64_t>> shapes;
    const size_t first = members.size();
    for (const MatrixView& m : matrices) {
      const auto shape = std::make_pair(m.rows, m.cols);
      const auto it = std::find(shapes.begin(), shapes.end(), shape);
      if (it == shapes.end()) {
        shapes.push_back(shape);
        members.push_back({m});
      } else {
        members[first + (it - shapes.begin())].push_back(m);
      }
    }
    for (size_t s = 0; s < shapes.size(); ++s) {
      const auto [rows, cols] = shapes[s];
      const std::vector<MatrixView>& same = members[first + s];
      const int64_t max_batch =
          NsBatchLimit(options.ns_batch_size, rows, cols,
                       int64_t(DTypeSize(work_dtype_)), auto_on_device);
      const ShapeKey shape_key{ns_key, max_batch, rows, cols};
      const auto shape_batch = batch_of_shape_.find(shape_key);
      int64_t cap = shape_batch != batch_of_shape_.end() ? shape_batch->second
                                                         : max_batch;
      for (size_t begin = 0; begin < same.size();) {
        const int64_t want =
            std::min<int64_t>(cap, int64_t(same.size()) - begin);
        const absl::Span<const MatrixView> run =
            absl::MakeConstSpan(same).subspan(begin, want);
        ASSIGN_OR_RETURN(
            const int64_t batch,
            FitBatch(options, ns_key, rows, cols, want, IsStacked(run)));
        // A batch the budget cut caps the shape from now on. A short list
        // (fewer matrices than the cap) leaves the cap as it was: a group
        // with one matrix of a shape must not cap the batches of another
        // group sharing the runner.
        if (batch < want) cap = batch_of_shape_[shape_key] = batch;
        Chunk chunk{nullptr, rows, cols, run.subspan(0, batch),
                    ChunkKind::kStaged};
        begin += batch;
        ASSIGN_OR_RETURN(chunk.ns, GetNs(options, ns_key, rows, cols, batch));
        if (batch == 1) {
          chunk.kind = ChunkKind::kSingle;
        } else if (IsStacked(chunk.members)) {
          chunk.kind = ChunkKind::kStacked;
        } else {
          staging_elems = std::max(staging_elems, batch * rows * cols);
        }
        chunks.push_back(chunk);
      }
    }
  }
  if (staging_elems > staging_elems_) {
    ASSIGN_OR_RETURN(staging_,
                     AllocateZeroed(backend_, work_dtype_, 1, staging_elems));
    staging_elems_ = staging_elems;
  }
  return chunks;
}

absl::Status NsRunner::RunChunk(const Chunk& chunk) {
  const MatrixView& first = chunk.members[0];
  // The result overwrites the input in its own dtype (NsResultDType).
  const DType result = chunk.ns->result_dtype();
  switch (chunk.kind) {
    case ChunkKind::kSingle:
      // The unbatched path, in place: bit-exact numerics contract.
      return chunk.ns->Run(first, NsResultOver(first, result), 1);
    case ChunkKind::kStacked: {
      const int64_t batch = int64_t(chunk.members.size());
      const MatrixView stacked = ContiguousView(first.data, work_dtype_,
                                                batch * chunk.rows, chunk.cols);
      return chunk.ns->Run(stacked, NsResultOver(stacked, result), batch);
    }
    case ChunkKind::kStaged:
      return RunStaged(*chunk.ns, chunk.members);
  }
  return absl::InternalError("ns runner: unknown chunk kind");
}

uint64_t NsRunner::GraphKey(const MuonOptions& options, uint64_t ns_key,
                            const std::vector<Chunk>& chunks) const {
  KeyHasher h;
  h.Add(id_);
  h.Add(uint64_t(work_dtype_));
  h.Add(ns_key);
  h.Add(uint64_t(options.ns_batch_size));
  h.Add(staging_.data());
  h.Add(uint64_t(chunks.size()));
  for (const Chunk& chunk : chunks) {
    h.Add(static_cast<const void*>(chunk.ns));
    h.Add(uint64_t(chunk.kind));
    h.Add(uint64_t(chunk.members.size()));
    for (const MatrixView& m : chunk.members) h.Add(m);
  }
  return h.Finish();
}

NsRunner& NsRunner::operator=(NsRunner&& other) noexcept {
  if (this == &other) return *this;
  if (budget_ != nullptr) budget_->Give(taken_);
  engines_ = std::move(other.engines_);
  staging_ = std::move(other.staging_);
  batch_of_shape_ = std::move(other.batch_of_shape_);
  backend_ = other.backend_;
  work_dtype_ = other.work_dtype_;
  budget_ = other.budget_;
  taken_ = std::exchange(other.taken_, 0);
  staging_elems_ = std::exchange(other.staging_elems_, 0);
  use_graphs_ = other.use_graphs_;
  id_ = other.id_;
  return *this;
}

NsRunner::~NsRunner() {
  if (budget_ != nullptr) budget_->Give(taken_);
}

absl::StatusOr<int64_t> NsRunner::FitBatch(const MuonOptions& options,
                                           uint64_t ns_key, int64_t rows,
                                           int64_t cols, int64_t want,
                                           bool stacked) {
  if (budget_ == nullptr) return want;
  const int64_t es = int64_t(DTypeSize(work_dtype_));
  for (int64_t batch = want;; batch = (batch + 1) / 2) {
    // The staging buffer is one, sized by the largest staged batch: only
    // its growth is charged (an engine made for stacked chunks may run
    // staged ones later).
    const int64_t staged = batch > 1 && !stacked ? batch * rows * cols : 0;
    int64_t bytes = std::max<int64_t>(0, staged - staging_charged_elems_) * es;
    if (!engines_.contains({ns_key, rows, cols, batch})) {
      bytes += NewtonSchulz::WorkspaceBytes(options.ns, rows, cols, batch);
    }
    bool granted = bytes == 0;
    if (!granted) {
      ASSIGN_OR_RETURN(granted, budget_->TryTake(*backend_, bytes));
    }
    if (granted) {
      taken_ += bytes;
      staging_charged_elems_ = std::max(staging_charged_elems_, staged);
      if (batch < want) {
        LOG(WARNING) << "ns: " << rows << "x" << cols << " matrices run in "
                     << "batches of " << batch << ", not " << want
                     << ": the workspace of " << want << " does not fit ("
                     << budget_->Describe(*backend_, bytes) << ")";
      }
      return batch;
    }
    if (batch == 1) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "ns: no memory for the Newton-Schulz workspace of one ", rows, "x",
          cols, " matrix: ", budget_->Describe(*backend_, bytes),
          ". Free device memory (another process may hold it), raise "
          "--max_ns_workspace_bytes, or spread the matrices over more "
          "daemons"));
    }
  }
}

absl::StatusOr<NewtonSchulz*> NsRunner::GetNs(const MuonOptions& options,
                                              uint64_t ns_key, int64_t rows,
                                              int64_t cols, int64_t batch) {
  const EngineKey key{ns_key, rows, cols, batch};
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
  if (batch * rows * cols > staging_elems_) {
    return absl::InternalError(
        "ns runner: staging buffer smaller than a chunk");
  }
  const MatrixView stacked =
      ContiguousView(staging_.data(), work_dtype_, batch * rows, cols);
  for (int64_t b = 0; b < batch; ++b) {
    RETURN_IF_ERROR(
        backend_->Copy2D(stacked.Block(b * rows, 0, rows, cols), chunk[b]));
  }
  const DType result = ns.result_dtype();
  const MatrixView out = NsResultOver(stacked, result);
  RETURN_IF_ERROR(ns.Run(stacked, out, batch));
  for (int64_t b = 0; b < batch; ++b) {
    RETURN_IF_ERROR(backend_->Copy2D(NsResultOver(chunk[b], result),
                                     out.Block(b * rows, 0, rows, cols)));
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
