// NsRunner and Backend::RunGraph on the CPU backend: the default RunGraph
// runs its work once and returns its status; NsRunner runs an unmeasured Run
// (or RunLists) as exactly one RunGraph and a measured one without; either
// way every
// matrix equals its own NewtonSchulz run (the reference: one engine per
// chunk, run directly) bitwise, over a mixed-shape list with single, stacked
// and staged chunks.
#include "core/step/ns_runner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/backend/bf16.h"
#include "core/backend/cpu_backend.h"
#include "core/backend/fp16.h"
#include "core/step/ns_batch_rule.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

// The CPU backend, counting RunGraph calls (every other call delegated).
class CountingBackend final : public testing::DelegatingBackend {
 public:
  int graph_runs = 0;
  // What Memory() reports; unset: Unimplemented (no measure).
  std::optional<MemoryInfo> memory;

  absl::StatusOr<MemoryInfo> Memory() override {
    if (memory) return *memory;
    return absl::UnimplementedError("no memory measure");
  }
  absl::Status RunGraph(uint64_t key,
                        const std::function<absl::Status()>& work) override {
    ++graph_runs;
    return DelegatingBackend::RunGraph(key, work);
  }
  // Waits, and the waits before the last NS's normalisation (its first call).
  int syncs = 0, syncs_before_normalize = -1;
  absl::Status Synchronize() override {
    ++syncs;
    return DelegatingBackend::Synchronize();
  }
  absl::Status FrobeniusNormalize(const MatrixView& src, const MatrixView& dst,
                                  int64_t batch, float eps) override {
    if (syncs_before_normalize < 0) syncs_before_normalize = syncs;
    return DelegatingBackend::FrobeniusNormalize(src, dst, batch, eps);
  }
};

TEST(RunGraphTest, DefaultRunsWorkOnceAndReturnsItsStatus) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  int runs = 0;
  EXPECT_TRUE(cpu->RunGraph(7,
                            [&] {
                              ++runs;
                              return absl::OkStatus();
                            })
                  .ok());
  EXPECT_EQ(runs, 1);
  const absl::Status failed = cpu->RunGraph(7, [&] {
    ++runs;
    return absl::InvalidArgumentError("from work");
  });
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(failed, absl::InvalidArgumentError("from work"));
}

// An MoE-like list: 3 shapes interleaved (wide, tall, square), 20 matrices.
// The first 8 wide ones lie back to back (a stacked chunk), the rest are
// separate host vectors (staged chunks), and one shape appears once (a
// single chunk).
struct MixedList {
  std::vector<std::vector<float>> owned;
  std::vector<float> slab;
  std::vector<MatrixView> views;

  MixedList() {
    std::mt19937 rng(11);
    std::normal_distribution<float> d(0.0f, 1.0f);
    const int64_t wr = 12, wc = 20;
    slab.resize(8 * wr * wc);
    for (float& x : slab) x = d(rng);
    for (int i = 0; i < 8; ++i) {
      views.push_back(
          ContiguousView(slab.data() + i * wr * wc, DType::kFloat32, wr, wc));
    }
    const std::pair<int64_t, int64_t> shapes[] = {{20, 12}, {12, 20}, {16, 16}};
    for (int i = 0; i < 11; ++i) {
      const auto [r, c] = shapes[i % 2];
      owned.emplace_back(r * c);
      for (float& x : owned.back()) x = d(rng);
      views.push_back(
          ContiguousView(owned.back().data(), DType::kFloat32, r, c));
    }
    const auto [r, c] = shapes[2];
    owned.emplace_back(r * c);
    for (float& x : owned.back()) x = d(rng);
    views.push_back(ContiguousView(owned.back().data(), DType::kFloat32, r, c));
  }
  std::vector<float> Flat() const {
    std::vector<float> all;
    for (const MatrixView& v : views) {
      const float* p = static_cast<const float*>(v.data);
      all.insert(all.end(), p, p + v.numel());
    }
    return all;
  }
};

MuonOptions Options() {
  MuonOptions o;
  o.ns_batch_size = 4;
  return o;
}

// The reference: each chunk NsRunner forms (same-shape matrices in list
// order, up to ns_batch_size) through its own engine, stacked in a copy.
std::vector<float> Reference(Backend* backend, const MuonOptions& options,
                             const MixedList& list) {
  std::vector<std::vector<float>> out(list.views.size());
  std::vector<bool> done(list.views.size(), false);
  for (size_t i = 0; i < list.views.size(); ++i) {
    if (done[i]) continue;
    const int64_t r = list.views[i].rows, c = list.views[i].cols;
    std::vector<size_t> same;
    for (size_t j = i; j < list.views.size(); ++j) {
      if (!done[j] && list.views[j].rows == r && list.views[j].cols == c) {
        same.push_back(j);
        done[j] = true;
      }
    }
    for (size_t b0 = 0; b0 < same.size(); b0 += options.ns_batch_size) {
      const size_t n =
          std::min<size_t>(options.ns_batch_size, same.size() - b0);
      std::vector<float> stacked;
      for (size_t k = 0; k < n; ++k) {
        const float* p =
            static_cast<const float*>(list.views[same[b0 + k]].data);
        stacked.insert(stacked.end(), p, p + r * c);
      }
      auto ns = *NewtonSchulz::Create(backend, options.ns, r, c, int64_t(n));
      const MatrixView v =
          ContiguousView(stacked.data(), DType::kFloat32, int64_t(n) * r, c);
      EXPECT_TRUE(ns->Run(v, v, int64_t(n)).ok());
      for (size_t k = 0; k < n; ++k) {
        out[same[b0 + k]].assign(stacked.begin() + k * r * c,
                                 stacked.begin() + (k + 1) * r * c);
      }
    }
  }
  std::vector<float> all;
  for (const auto& o : out) all.insert(all.end(), o.begin(), o.end());
  return all;
}

TEST(NsRunnerTest, UnmeasuredRunIsOneRunGraphAndBitwiseTheReference) {
  CountingBackend backend;
  const MuonOptions options = Options();
  MixedList graph_list, direct_list, measured_list;
  const std::vector<float> want = Reference(&backend, options, graph_list);
  ASSERT_EQ(backend.graph_runs, 0);

  NsRunner runner(&backend, DType::kFloat32);
  ASSERT_TRUE(runner.Run(options, graph_list.views, nullptr).ok());
  EXPECT_EQ(backend.graph_runs, 1);
  EXPECT_EQ(graph_list.Flat(), want);

  NsRunner direct(&backend, DType::kFloat32);
  direct.set_use_graphs(false);
  ASSERT_TRUE(direct.Run(options, direct_list.views, nullptr).ok());
  EXPECT_EQ(backend.graph_runs, 1);
  EXPECT_EQ(direct_list.Flat(), want);

  ShapeTimes times;
  backend.syncs = 0;
  backend.syncs_before_normalize = -1;
  ASSERT_TRUE(runner.Run(options, measured_list.views, &times).ok());
  EXPECT_EQ(backend.graph_runs, 1);  // a measured Run keeps per-chunk syncs
  // Its first chunk's time starts with the queue empty (the phases before
  // it do not wait for their work).
  EXPECT_EQ(backend.syncs_before_normalize, 1);
  EXPECT_EQ(measured_list.Flat(), want);
  int64_t counted = 0;
  for (const ShapeTiming& t : times.ByShape()) counted += t.count;
  EXPECT_EQ(counted, int64_t(measured_list.views.size()));
}

TEST(NsRunnerTest, RunListsIsOneRunGraphAndEachListChunkedAlone) {
  CountingBackend backend;
  const MuonOptions options = Options();
  MixedList lists_list, separate_list;
  auto halves = [](const MixedList& l) {
    const absl::Span<const MatrixView> all = l.views;
    return std::vector<absl::Span<const MatrixView>>{all.subspan(0, 10),
                                                     all.subspan(10)};
  };
  NsRunner runner(&backend, DType::kFloat32);
  ASSERT_TRUE(runner.RunLists(options, halves(lists_list), nullptr).ok());
  EXPECT_EQ(backend.graph_runs, 1);
  NsRunner separate(&backend, DType::kFloat32);
  separate.set_use_graphs(false);
  for (absl::Span<const MatrixView> half : halves(separate_list))
    ASSERT_TRUE(separate.Run(options, half, nullptr).ok());
  EXPECT_EQ(backend.graph_runs, 1);
  EXPECT_EQ(lists_list.Flat(), separate_list.Flat());
}

// ChunksOf names every matrix once, in chunks of one shape of at most
// ns_batch_size, and running the list chunk by chunk (each a sublist, as the
// streamed host-state phase does) is bitwise the whole list's Run.
TEST(NsRunnerTest, RunningChunksOfAloneIsBitwiseTheWholeRun) {
  CountingBackend backend;
  const MuonOptions options = Options();
  MixedList whole_list, chunked_list;
  const std::vector<float> want = Reference(&backend, options, whole_list);
  NsRunner runner(&backend, DType::kFloat32);
  auto chunks = runner.ChunksOf(options, chunked_list.views);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  std::vector<int> seen(chunked_list.views.size(), 0);
  for (const std::vector<size_t>& chunk : *chunks) {
    ASSERT_FALSE(chunk.empty());
    ASSERT_LE(int64_t(chunk.size()), options.ns_batch_size);
    std::vector<MatrixView> members;
    for (size_t i : chunk) {
      ++seen[i];
      members.push_back(chunked_list.views[i]);
      EXPECT_EQ(members.back().rows, members.front().rows);
      EXPECT_EQ(members.back().cols, members.front().cols);
    }
    ASSERT_TRUE(runner.Run(options, members, nullptr).ok());
  }
  EXPECT_THAT(seen, ::testing::Each(1));
  EXPECT_EQ(chunked_list.Flat(), want);
}

// Medium precision: where a shape runs Gram NS (fp16 iterations), the
// runner leaves its result over the bf16 input in fp16 (NsResultDType), the
// bits of the engine's own Run into an fp16 output, with no converting pass;
// rounded to bf16 they are what Run into a bf16 output gives. A square shape
// (standard NS) stays bf16. Stacked, staged and single chunks alike.
TEST(NsRunnerTest, MediumGramResultIsLeftInFp16OverItsBf16Input) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  MuonOptions options;
  options.ns.precision = MatmulPrecision::kMedium;
  options.ns_batch_size = 3;
  const int64_t r = 12, c = 40;  // aspect 3.3: Gram (auto)
  ASSERT_EQ(NsResultDType(options.ns, r, c), DType::kFloat16);
  ASSERT_EQ(NsResultDType(options.ns, 16, 16), DType::kBFloat16);
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  auto bf16 = [&](int64_t n) {
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v) x = FloatToBf16Bits(d(rng));
    return v;
  };
  // 3 wide matrices back to back (stacked), 2 apart (staged), 1 tall (a
  // single chunk, Gram on the transpose), 1 square.
  std::vector<uint16_t> slab = bf16(3 * r * c);
  std::vector<std::vector<uint16_t>> apart = {bf16(r * c), bf16(r * c)};
  std::vector<uint16_t> tall = bf16(c * r);
  std::vector<uint16_t> square = bf16(16 * 16);
  std::vector<MatrixView> views;
  for (int k = 0; k < 3; ++k) {
    views.push_back(
        ContiguousView(slab.data() + k * r * c, DType::kBFloat16, r, c));
  }
  for (auto& a : apart) {
    views.push_back(ContiguousView(a.data(), DType::kBFloat16, r, c));
  }
  views.push_back(ContiguousView(tall.data(), DType::kBFloat16, c, r));
  views.push_back(ContiguousView(square.data(), DType::kBFloat16, 16, 16));
  // The references, from copies of the inputs.
  auto run = [&](std::vector<uint16_t> in, int64_t rows, int64_t cols,
                 int64_t batch, DType out_dtype) {
    auto ns = *NewtonSchulz::Create(cpu.get(), options.ns, rows, cols, batch);
    std::vector<uint16_t> out(in.size());
    EXPECT_TRUE(
        ns->Run(ContiguousView(in.data(), DType::kBFloat16, batch * rows, cols),
                ContiguousView(out.data(), out_dtype, batch * rows, cols),
                batch)
            .ok());
    return out;
  };
  std::vector<uint16_t> staged_in = apart[0];
  staged_in.insert(staged_in.end(), apart[1].begin(), apart[1].end());
  const std::vector<uint16_t> want_stacked =
      run(slab, r, c, 3, DType::kFloat16);
  const std::vector<uint16_t> want_staged =
      run(staged_in, r, c, 2, DType::kFloat16);
  const std::vector<uint16_t> want_tall = run(tall, c, r, 1, DType::kFloat16);
  const std::vector<uint16_t> want_square =
      run(square, 16, 16, 1, DType::kBFloat16);
  const std::vector<uint16_t> bf16_stacked =
      run(slab, r, c, 3, DType::kBFloat16);

  NsRunner runner(cpu.get(), DType::kBFloat16);
  ASSERT_TRUE(runner.Run(options, views, nullptr).ok());
  EXPECT_EQ(slab, want_stacked);
  std::vector<uint16_t> got_staged = apart[0];
  got_staged.insert(got_staged.end(), apart[1].begin(), apart[1].end());
  EXPECT_EQ(got_staged, want_staged);
  EXPECT_EQ(tall, want_tall);
  EXPECT_EQ(square, want_square);
  for (size_t k = 0; k < slab.size(); ++k) {
    ASSERT_EQ(FloatToBf16Bits(Fp16BitsToFloat(slab[k])), bf16_stacked[k]) << k;
  }
}

// A runner shared by several groups (a lane's): a list with one matrix of a
// shape does not cap the batches of a later list with more.
TEST(NsRunnerTest, AShortListDoesNotCapALongerOnesBatches) {
  CountingBackend backend;
  const MuonOptions options = Options();  // ns_batch_size 4
  std::vector<float> one(16 * 16, 0.5f), four(4 * 16 * 16, 0.25f);
  NsRunner runner(&backend, DType::kFloat32);
  auto short_chunks = runner.ChunksOf(
      options, {ContiguousView(one.data(), DType::kFloat32, 16, 16)});
  ASSERT_TRUE(short_chunks.ok()) << short_chunks.status();
  EXPECT_EQ(short_chunks->size(), 1u);
  std::vector<MatrixView> views;
  for (int k = 0; k < 4; ++k) {
    views.push_back(
        ContiguousView(four.data() + k * 16 * 16, DType::kFloat32, 16, 16));
  }
  auto long_chunks = runner.ChunksOf(options, views);
  ASSERT_TRUE(long_chunks.ok()) << long_chunks.status();
  ASSERT_EQ(long_chunks->size(), 1u);
  EXPECT_EQ(long_chunks->front().size(), 4u);
}

// ns_batch_size 0 (auto): on a device, shapes with a short side <= 2048
// batch up to 2^29 bytes of the NS work dtype, wider ones run one at a time;
// on the host (slice by slice anyway) one at a time; a set size is taken as
// given.
TEST(NsBatchLimitTest, AutoBatchesByShortSideBytesAndBackend) {
  constexpr int64_t kBf16 = 2, kFp32 = 4;
  EXPECT_EQ(NsBatchLimit(0, 16, 16, kBf16, true), (int64_t{1} << 29) / 512);
  EXPECT_EQ(NsBatchLimit(0, 2048, 8192, kBf16, true), 16);  // ~1B Llama MLP
  EXPECT_EQ(NsBatchLimit(0, 8192, 2048, kBf16, true), 16);
  EXPECT_EQ(NsBatchLimit(0, 8192, 2048, kFp32, true), 8);  // "highest"
  EXPECT_EQ(NsBatchLimit(0, 2048, 2048, kBf16, true), 64);
  EXPECT_EQ(NsBatchLimit(0, 2049, 8192, kBf16, true), 1);     // past the side
  EXPECT_EQ(NsBatchLimit(0, 4096, 14336, kBf16, true), 1);    // Llama-3-8B's
  EXPECT_EQ(NsBatchLimit(0, 1024, 1 << 20, kBf16, true), 1);  // past the cap
  EXPECT_EQ(NsBatchLimit(0, 16, 16, kFp32, false), 1);  // the host backend
  EXPECT_EQ(NsBatchLimit(3, 4096, 4096, kBf16, true), 3);
  EXPECT_EQ(NsBatchLimit(5, 16, 16, kFp32, false), 5);
  EXPECT_EQ(NsBatchLimit(1, 16, 16, kBf16, true), 1);
}

// On a backend that calls itself a device (the CPU backend's math), auto
// chunks a small shape's matrices into one batch, bitwise the per-matrix
// path (the CPU backend's batched NS runs slice by slice); on the CPU
// backend as it is, auto runs them one at a time.
TEST(NsRunnerTest, AutoBatchSizeBatchesASmallShapeOnADeviceOnly) {
  MuonOptions automatic;
  automatic.ns_batch_size = 0;
  ASSERT_TRUE(automatic.Validate().ok()) << automatic.Validate();
  MuonOptions per_matrix = automatic;
  per_matrix.ns_batch_size = 1;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist;
  std::vector<float> a(6 * 24 * 40), b;
  for (float& x : a) x = dist(rng);
  b = a;
  auto views = [](std::vector<float>& data) {
    std::vector<MatrixView> v;
    for (int k = 0; k < 6; ++k) {
      v.push_back(
          ContiguousView(data.data() + k * 24 * 40, DType::kFloat32, 24, 40));
    }
    return v;
  };
  testing::DeviceLikeCpuBackend device;
  NsRunner runner(&device, DType::kFloat32);
  auto chunks = runner.ChunksOf(automatic, views(a));
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 1u);
  EXPECT_EQ(chunks->front().size(), 6u);
  ASSERT_TRUE(runner.Run(automatic, views(a), nullptr).ok());
  CountingBackend host;
  NsRunner single(&host, DType::kFloat32);
  auto host_chunks = single.ChunksOf(automatic, views(b));
  ASSERT_TRUE(host_chunks.ok()) << host_chunks.status();
  EXPECT_EQ(host_chunks->size(), 6u);
  ASSERT_TRUE(single.Run(per_matrix, views(b), nullptr).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  MuonOptions negative = automatic;
  negative.ns_batch_size = -1;
  EXPECT_THAT(
      std::string(negative.Validate().message()),
      ::testing::HasSubstr("ns_batch_size must be >= 1, or 0 for auto"));
}

TEST(NsRunnerTest, EmptyListRunsNothing) {
  CountingBackend backend;
  NsRunner runner(&backend, DType::kFloat32);
  EXPECT_TRUE(runner.Run(Options(), {}, nullptr).ok());
  EXPECT_EQ(backend.graph_runs, 0);
}

}  // namespace
}  // namespace muond

namespace muond {
namespace {

// The workspace NsRunner::FitBatch asks for: the engine's, plus the staging
// of a batch that is not back to back.
int64_t Need(const MuonOptions& o, int64_t r, int64_t c, int64_t batch,
             bool stacked) {
  return NewtonSchulz::WorkspaceBytes(o.ns, r, c, batch) +
         (batch > 1 && !stacked ? batch * r * c * 4 : 0);
}

// A device with room for no batch of 4 of any shape of the list but for a
// batch of 2 of every one: every shape runs in batches of 2, bitwise the
// chunks ns_batch_size 2 forms; the bytes go back to the budget with the
// runner.
TEST(NsRunnerTest, ABatchThatDoesNotFitFreeMemoryRunsInHalves) {
  CountingBackend backend;
  const MuonOptions options = Options();  // ns_batch_size 4
  MuonOptions halved = options;
  halved.ns_batch_size = 2;
  const int64_t room =
      std::max({Need(options, 12, 20, 2, true), Need(options, 20, 12, 2, false),
                Need(options, 16, 16, 1, false)});
  ASSERT_LT(room, Need(options, 12, 20, 4, true));
  ASSERT_LT(room, Need(options, 20, 12, 4, false));
  const int64_t total = int64_t(1) << 30;
  backend.memory = MemoryInfo{
      NsWorkspaceBudget::Reserve(MemoryInfo{0, total}) + room, total};
  MixedList list, reference_list;
  const std::vector<float> want = Reference(&backend, halved, reference_list);
  NsWorkspaceBudget budget;
  {
    NsRunner runner(&backend, DType::kFloat32, &budget);
    ASSERT_TRUE(runner.Run(options, list.views, nullptr).ok());
    EXPECT_EQ(list.Flat(), want);
    EXPECT_GT(budget.taken(), 0);
    EXPECT_EQ(budget.peak(), budget.taken());
    // Later runs keep the batches (no new engine, nothing more taken).
    const int64_t taken = budget.taken();
    MixedList again;
    ASSERT_TRUE(runner.Run(options, again.views, nullptr).ok());
    EXPECT_EQ(again.Flat(), want);
    EXPECT_EQ(budget.taken(), taken);
    NsRunner moved = std::move(runner);
    EXPECT_EQ(budget.taken(), taken);
  }
  EXPECT_EQ(budget.taken(), 0);
}

// Staged chunks of two shapes share one staging buffer, sized by the larger:
// the budget is charged each shape's workspace and that buffer once. The
// engines of an unbounded budget: 12x20 and 20x12, four of each, none back
// to back (so staged), one batch of 4 each.
TEST(NsRunnerTest, TheStagingBufferIsChargedOnceByTheLargestBatch) {
  CountingBackend backend;
  const MuonOptions options = Options();  // ns_batch_size 4
  std::vector<std::vector<float>> owned;
  std::vector<MatrixView> views;
  for (int i = 0; i < 8; ++i) {
    const int64_t r = i % 2 == 0 ? 12 : 20, c = i % 2 == 0 ? 20 : 12;
    owned.emplace_back(r * c, 0.01f * float(i + 1));
    views.push_back(ContiguousView(owned.back().data(), DType::kFloat32, r, c));
  }
  NsWorkspaceBudget budget;
  NsRunner runner(&backend, DType::kFloat32, &budget);
  ASSERT_TRUE(runner.Run(options, views, nullptr).ok());
  EXPECT_EQ(budget.taken(),
            NewtonSchulz::WorkspaceBytes(options.ns, 12, 20, 4) +
                NewtonSchulz::WorkspaceBytes(options.ns, 20, 12, 4) +
                4 * 12 * 20 * 4);
}

TEST(NsRunnerTest, NotOneMatrixFittingIsResourceExhaustedWithTheNumbers) {
  CountingBackend backend;
  const int64_t total = int64_t(1) << 30;
  backend.memory =
      MemoryInfo{NsWorkspaceBudget::Reserve(MemoryInfo{0, total}) + 8, total};
  NsWorkspaceBudget budget;
  NsRunner runner(&backend, DType::kFloat32, &budget);
  MixedList list;
  const std::vector<float> before = list.Flat();
  const absl::Status st = runner.Run(Options(), list.views, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(
      std::string(st.message()),
      ::testing::AllOf(::testing::HasSubstr("one 12x20 matrix"),
                       ::testing::HasSubstr("bytes needed"),
                       ::testing::HasSubstr("bytes free"),
                       ::testing::HasSubstr("--max_ns_workspace_bytes")));
  EXPECT_EQ(list.Flat(), before);  // nothing ran
  EXPECT_EQ(budget.taken(), 0);
}

// The cap bounds every runner's engines together (a backend without a
// memory measure is held to the cap alone): a second runner past it is
// refused naming the cap, and gets its room once the first is gone.
TEST(NsRunnerTest, TheCapBoundsAllRunnersTogether) {
  CountingBackend backend;
  const MuonOptions options = Options();
  NsWorkspaceBudget unbounded;
  {
    NsRunner probe(&backend, DType::kFloat32, &unbounded);
    MixedList list;
    ASSERT_TRUE(probe.Run(options, list.views, nullptr).ok());
  }
  const int64_t all = unbounded.peak();
  NsWorkspaceBudget budget(all);
  auto first = std::make_unique<NsRunner>(&backend, DType::kFloat32, &budget);
  MixedList a, b;
  ASSERT_TRUE(first->Run(options, a.views, nullptr).ok());
  EXPECT_EQ(budget.taken(), all);
  NsRunner second(&backend, DType::kFloat32, &budget);
  const absl::Status st = second.Run(options, b.views, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_THAT(std::string(st.message()),
              ::testing::HasSubstr(absl::StrCat("(cap ", all, ")")));
  first.reset();
  EXPECT_EQ(budget.taken(), 0);
  ASSERT_TRUE(second.Run(options, b.views, nullptr).ok());
  EXPECT_EQ(a.Flat(), b.Flat());
}

}  // namespace
}  // namespace muond
