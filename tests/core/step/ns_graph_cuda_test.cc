// CUDA graphs of Newton–Schulz (tag gpu; skipped without a device). The
// reference is the same work enqueued call by call on the same backend, so
// every comparison is bitwise:
// * NewtonSchulz::Run through Backend::RunGraph (standard NS at highest and
//   medium, batched and not; Gram NS in fp16 where the engine has it):
//   equal to the direct run; a replay after new data is written into the
//   same buffers reads the new data; another pointer under another key is a
//   new capture.
// * NsRunner over an MoE-like list (64 matrices of 3 shapes: stacked,
//   staged and single chunks; standard NS at highest and medium, Gram NS in
//   fp16): the graph path equals the direct path, on a
//   second step with fresh data too (a replay, no new capture), and other
//   buffers capture anew.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <tuple>
#include <vector>

#include "core/backend/cuda_backend.h"
#include "core/muon/newton_schulz.h"
#include "core/step/ns_runner.h"
#include "tests/common/cuda_test.h"

namespace muond {
namespace {

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

class NsGraphCudaTest : public muond::testing::CudaTest {
 protected:
  void Put(void* dev, const std::vector<float>& host) {
    ASSERT_TRUE(
        gpu_->CopyFromHost(dev, host.data(), int64_t(host.size()) * 4).ok());
    ASSERT_TRUE(gpu_->Synchronize().ok());  // host buffer may go away
  }
  CudaGraphCounts Counts() const { return GetCudaGraphCounts(*gpu_); }
  // Runs `o`'s NS on batch x (r x c) directly and through RunGraph(key).
  void CheckNsGraph(const NsOptions& o, int64_t r, int64_t c, int64_t batch,
                    uint64_t key);
};

// Runs NS on `ns` from in to out, directly or as RunGraph(key).
absl::Status RunNs(Backend& backend, NewtonSchulz& ns, const MatrixView& in,
                   const MatrixView& out, int64_t batch, uint64_t key,
                   bool graph) {
  if (!graph) return ns.Run(in, out, batch);
  return backend.RunGraph(key, [&] { return ns.Run(in, out, batch); });
}

void NsGraphCudaTest::CheckNsGraph(const NsOptions& o, int64_t r, int64_t c,
                                   int64_t batch, uint64_t key) {
  Backend& gpu = *gpu_;
  auto dev = [&](int64_t bytes) { return Dev(bytes); };
  auto put = [&](void* d, const std::vector<float>& h) { Put(d, h); };
  auto get = [&](const void* d, int64_t n) { return Down<float>(d, n); };
  auto counts = [&] { return Counts(); };
  auto created = NewtonSchulz::Create(&gpu, o, r, c, batch);
  ASSERT_TRUE(created.ok()) << created.status();
  NewtonSchulz& ns = **created;
  const int64_t n = batch * r * c;
  void* in = dev(n * 4);
  void* in2 = dev(n * 4);
  void* out = dev(n * 4);
  const MatrixView vin = ContiguousView(in, DType::kFloat32, batch * r, c);
  const MatrixView vin2 = ContiguousView(in2, DType::kFloat32, batch * r, c);
  const MatrixView vout = ContiguousView(out, DType::kFloat32, batch * r, c);
  std::vector<std::vector<float>> data = {Random(n, uint32_t(key)),
                                          Random(n, uint32_t(key) + 1)};
  std::vector<std::vector<float>> want;
  for (const auto& g : data) {
    put(in, g);
    ASSERT_TRUE(RunNs(gpu, ns, vin, vout, batch, key, false).ok());
    want.push_back(get(out, n));
  }
  ASSERT_NE(want[0], want[1]);
  const CudaGraphCounts before = counts();
  for (int i = 0; i < 2; ++i) {
    put(in, data[i]);  // new data, same buffers: the replay must read it
    put(out, std::vector<float>(n, 7.0f));
    ASSERT_TRUE(RunNs(gpu, ns, vin, vout, batch, key, true).ok());
    EXPECT_EQ(get(out, n), want[i]) << "replay " << i;
  }
  CudaGraphCounts after = counts();
  EXPECT_EQ(after.captures - before.captures, 1);
  EXPECT_EQ(after.launches - before.launches, 2);
  EXPECT_EQ(after.fallbacks, before.fallbacks);
  // Another input pointer under another key: a new capture, right result.
  put(in2, data[1]);
  ASSERT_TRUE(RunNs(gpu, ns, vin2, vout, batch, key + 1, true).ok());
  EXPECT_EQ(get(out, n), want[1]);
  after = counts();
  EXPECT_EQ(after.captures - before.captures, 2);
  EXPECT_EQ(after.fallbacks, before.fallbacks);
}

TEST_F(NsGraphCudaTest, NewtonSchulzGraphEqualsDirect) {
  uint64_t key = 100;
  for (MatmulPrecision p :
       {MatmulPrecision::kHighest, MatmulPrecision::kMedium}) {
    // 3072 x 4096 at medium: the Gram product on the Hopper symmetric GEMM
    // (FastSymmetricGemm), captured too.
    for (auto [r, c, batch] :
         {std::tuple<int64_t, int64_t, int64_t>{96, 160, 1},
          {160, 96, 4},
          {3072, 4096, 1}}) {
      NsOptions o;
      o.precision = p;
      SCOPED_TRACE(::testing::Message() << MatmulPrecisionName(p) << " " << r
                                        << "x" << c << " x" << batch);
      CheckNsGraph(o, r, c, batch, key += 10);
    }
  }
}

TEST_F(NsGraphCudaTest, GramNewtonSchulzFp16GraphEqualsDirect) {
  NsOptions o;
  o.precision = MatmulPrecision::kMedium;
  o.algorithm = NsAlgorithm::kGram;
  o.coefficient_type = CoefficientType::kPolarExpress;
  o.gram_min_aspect_ratio = 1.0;
  auto probe = NewtonSchulz::Create(gpu_.get(), o, 64, 256, 1);
  if (!probe.ok()) {
    GTEST_SKIP() << "Gram NS not available in this build: " << probe.status();
  }
  uint64_t key = 500;
  for (auto [r, c, batch] :
       {std::tuple<int64_t, int64_t, int64_t>{64, 256, 1}, {256, 64, 3}}) {
    SCOPED_TRACE(::testing::Message() << r << "x" << c << " x" << batch);
    CheckNsGraph(o, r, c, batch, key += 10);
  }
}

// 64 matrices of 3 shapes in the NS work dtype: the first 24 wide ones back
// to back in one slab (stacked chunks), the rest each in its own buffer
// (staged chunks, and a trailing single).
struct MoeList {
  std::vector<MatrixView> views;
  int64_t total = 0;  // elements
};

MoeList MakeMoeList(DType dtype, const std::function<void*(int64_t)>& dev) {
  MoeList list;
  const int64_t es = int64_t(DTypeSize(dtype));
  const int64_t wr = 32, wc = 96;
  char* slab = static_cast<char*>(dev(24 * wr * wc * es));
  for (int i = 0; i < 24; ++i) {
    list.views.push_back(
        ContiguousView(slab + i * wr * wc * es, dtype, wr, wc));
  }
  const std::pair<int64_t, int64_t> shapes[] = {{96, 32}, {32, 96}, {48, 48}};
  for (int i = 0; i < 40; ++i) {
    const auto [r, c] = shapes[i % 3];
    list.views.push_back(ContiguousView(dev(r * c * es), dtype, r, c));
  }
  for (const MatrixView& v : list.views) list.total += v.numel();
  return list;
}

TEST_F(NsGraphCudaTest, NsRunnerGraphPathEqualsDirectPathMoe) {
  for (auto [p, algorithm] :
       {std::pair{MatmulPrecision::kHighest, NsAlgorithm::kStandard},
        {MatmulPrecision::kMedium, NsAlgorithm::kStandard},
        {MatmulPrecision::kMedium, NsAlgorithm::kGram}}) {
    SCOPED_TRACE(::testing::Message() << MatmulPrecisionName(p) << " "
                                      << NsAlgorithmName(algorithm));
    MuonOptions options;
    options.ns.precision = p;
    options.ns.algorithm = algorithm;  // gram: fp16 on the 3:1 shapes
    options.ns_batch_size = 8;
    const DType dtype = NsWorkDType(p);
    auto dev = [&](int64_t bytes) { return Dev(bytes); };
    const MoeList graph_list = MakeMoeList(dtype, dev);
    const MoeList direct_list = MakeMoeList(dtype, dev);
    const MoeList other_list = MakeMoeList(dtype, dev);
    NsRunner graph_runner(gpu_.get(), dtype);
    NsRunner direct_runner(gpu_.get(), dtype);
    direct_runner.set_use_graphs(false);
    // Fills a list's matrices from `seed` (fp32 from the host into `stage`,
    // converted on the device into the work dtype); `read` the results,
    // each in the dtype NS leaves it in (NsResultDType: fp16 from Gram).
    void* stage = Dev(graph_list.total * 4);
    auto fill = [&](const MoeList& list, uint32_t seed) {
      Put(stage, Random(list.total, seed));
      int64_t off = 0;
      for (const MatrixView& v : list.views) {
        ASSERT_TRUE(
            gpu_->Copy2D(v, ContiguousView(static_cast<float*>(stage) + off,
                                           DType::kFloat32, v.rows, v.cols))
                .ok());
        off += v.numel();
      }
    };
    auto read = [&](const MoeList& list) {
      int64_t off = 0;
      for (const MatrixView& v : list.views) {
        EXPECT_TRUE(
            gpu_->Copy2D(
                    ContiguousView(static_cast<float*>(stage) + off,
                                   DType::kFloat32, v.rows, v.cols),
                    NsResultOver(v, NsResultDType(options.ns, v.rows, v.cols)))
                .ok());
        off += v.numel();
      }
      return Down<float>(stage, list.total);
    };
    const CudaGraphCounts start = Counts();
    for (uint32_t step = 0; step < 2; ++step) {
      fill(graph_list, 40 + step);
      fill(direct_list, 40 + step);
      ASSERT_TRUE(graph_runner.Run(options, graph_list.views, nullptr).ok());
      ASSERT_TRUE(direct_runner.Run(options, direct_list.views, nullptr).ok());
      const std::vector<float> got = read(graph_list);
      EXPECT_EQ(got, read(direct_list)) << "step " << step;
      // NS ran: every result within the polar factor's sigma bound, so
      // not the unit-normal inputs (whose largest entries pass 2).
      EXPECT_NE(got, Random(graph_list.total, 40 + step));
      EXPECT_LT(*std::max_element(got.begin(), got.end()), 1.5f);
      EXPECT_GT(*std::min_element(got.begin(), got.end()), -1.5f);
    }
    CudaGraphCounts now = Counts();
    EXPECT_EQ(now.captures - start.captures, 1);  // step 2 was a replay
    EXPECT_EQ(now.launches - start.launches, 2);
    EXPECT_EQ(now.fallbacks, start.fallbacks);
    // Other buffers, same runner: a new key, a new capture, same numbers.
    fill(other_list, 41);
    ASSERT_TRUE(graph_runner.Run(options, other_list.views, nullptr).ok());
    EXPECT_EQ(read(other_list), read(direct_list));
    now = Counts();
    EXPECT_EQ(now.captures - start.captures, 2);
    EXPECT_EQ(now.fallbacks, start.fallbacks);
  }
}

}  // namespace
}  // namespace muond
