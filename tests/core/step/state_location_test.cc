// state_location host: the optimizer state lives in host memory the backend
// reaches in place. The reference is the same engine with the state in
// device memory (StateLocation::kDevice) on the same backend, stepped with
// the same gradients: the same kernels run on the same values, so params and
// exported state must be equal bit for bit. On CUDA (tag gpu; skipped without
// a device) the host-state group streams (momentum over the bus on a stream
// of its own, overlapped with NS wave by wave; unmeasured steps only) at NS
// batch sizes 1 and 2, and the host-state engine must take the state's bytes
// less of the device's memory. fp8_e4m3 state (codes and block scales)
// likewise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/backend/cpu_backend.h"
#include "core/backend/cuda_backend.h"
#include "core/common/state_storage.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/cuda_device.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

struct Shape {
  const char* name;
  int64_t rows, cols;
  bool muon;
};
// Muon matrices of 1 MiB to 4 MiB of fp32 each (so the device memory the
// state takes is well above cudaMemGetInfo's granularity), and AdamW vectors.
constexpr Shape kShapes[] = {
    {"wq", 1024, 1024, true},    {"wk", 1024, 1024, true},
    {"w_up", 1024, 512, true},   {"wv", 1024, 1024, true},
    {"w_down", 512, 1024, true}, {"bias", 1, 1024, false},
    {"norm", 1, 512, false}};

// The CPU backend playing a device with streams, so the engine streams host
// momentum through its slots on a machine without a GPU: every stream runs
// its calls at once, so OrderBefore has nothing to order and the results are
// those of the streamed path's calls in the order it makes them.
class StreamingCpuBackend final : public testing::DelegatingBackend {
 public:
  bool is_device() const override { return true; }
  absl::StatusOr<std::unique_ptr<Backend>> NewStream() override {
    ++streams_made;
    return std::unique_ptr<Backend>(new StreamingCpuBackend());
  }
  int streams_made = 0;
};

float Value(int param, int step, int64_t i) {
  return float((param * 131 + step * 37 + i * 7) % 101) / 101.0f - 0.5f;
}

// One engine over backend memory: params, grads and the engine. The Muon
// matrices form one group, or with `group_per_matrix` a group each (as
// per-layer groups do: one lane, one after the other).
class Engine {
 public:
  Engine(Backend& backend, StateLocation where, int64_t ns_batch_size = 1,
         DType state_dtype = DType::kFloat32, bool group_per_matrix = false,
         bool double_buffer = false)
      : backend_(backend) {
    GroupConfig muon, adamw;
    muon.name = "matrices";
    muon.muon.lr = 0.02;
    muon.muon.ns_batch_size = ns_batch_size;
    muon.muon.state_dtype = state_dtype;
    muon.muon.nesterov = true;
    muon.muon.state_location = where;
    muon.muon.double_buffer_momentum = double_buffer;
    adamw.name = "vectors";
    adamw.algorithm = Algorithm::kAdamW;
    adamw.adamw.state_location = where;
    adamw.adamw.state_dtype = state_dtype;
    for (int p = 0; p < int(std::size(kShapes)); ++p) {
      const Shape& s = kShapes[p];
      std::vector<float> init(s.rows * s.cols);
      for (size_t i = 0; i < init.size(); ++i) init[i] = Value(p, 0, i);
      ParamBinding b;
      b.name = s.name;
      b.full_shape = {s.rows, s.cols};
      b.param = Upload(init, s.rows, s.cols);
      b.grad = Upload(init, s.rows, s.cols);
      (s.muon ? muon : adamw).params.push_back(b);
    }
    std::vector<GroupConfig> groups;
    if (group_per_matrix) {
      for (const ParamBinding& b : muon.params) {
        GroupConfig one = muon;
        one.name = "matrix " + b.name;
        one.params = {b};
        groups.push_back(one);
      }
    } else {
      groups.push_back(muon);
    }
    groups.push_back(adamw);
    absl::StatusOr<MemoryInfo> before = backend.Memory();
    auto created = LayerShardedMuon::Create(&backend, groups);
    absl::StatusOr<MemoryInfo> after = backend.Memory();
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) engine_ = std::move(*created);
    if (before.ok() && after.ok()) {
      device_bytes_taken_ = before->free_bytes - after->free_bytes;
    }
  }
  ~Engine() {
    engine_.reset();
    for (void* p : allocations_) backend_.Free(p);
  }

  // Writes step `step`'s gradients and steps.
  void Step(int step) {
    for (size_t p = 0; p < grads_.size(); ++p) {
      std::vector<float> g(grads_[p].numel());
      for (size_t i = 0; i < g.size(); ++i) g[i] = Value(int(p) + 7, step, i);
      ASSERT_TRUE(
          backend_.CopyFromHost(grads_[p].data, g.data(), g.size() * 4).ok());
    }
    ASSERT_TRUE(backend_.Synchronize().ok());
    auto result = engine_->Step({});
    ASSERT_TRUE(result.ok()) << result.status();
  }
  std::vector<std::vector<float>> Params() {
    std::vector<std::vector<float>> out;
    for (const MatrixView& v : params_) {
      out.emplace_back(v.numel());
      EXPECT_TRUE(
          backend_.CopyToHost(out.back().data(), v.data, v.numel() * 4).ok());
    }
    return out;
  }
  LayerShardedMuon& engine() { return *engine_; }
  int64_t device_bytes_taken() const { return device_bytes_taken_; }

 private:
  MatrixView Upload(const std::vector<float>& host, int64_t rows,
                    int64_t cols) {
    void* p = *backend_.Allocate(int64_t(host.size()) * 4);
    allocations_.push_back(p);
    EXPECT_TRUE(backend_.CopyFromHost(p, host.data(), host.size() * 4).ok());
    EXPECT_TRUE(backend_.Synchronize().ok());
    MatrixView v = ContiguousView(p, DType::kFloat32, rows, cols);
    (params_.size() == grads_.size() ? params_ : grads_).push_back(v);
    return v;
  }
  Backend& backend_;
  std::vector<void*> allocations_;
  std::vector<MatrixView> params_, grads_;
  std::unique_ptr<LayerShardedMuon> engine_;
  int64_t device_bytes_taken_ = 0;
};

// Four steps on each engine (per-shape timing measures some: both paths);
// params and exported state equal bitwise.
void ExpectHostStateEqualsDeviceState(Backend& backend,
                                      int64_t ns_batch_size = 1,
                                      DType state_dtype = DType::kFloat32,
                                      bool group_per_matrix = false) {
  Engine device(backend, StateLocation::kDevice, ns_batch_size, state_dtype,
                group_per_matrix);
  Engine host(backend, StateLocation::kHost, ns_batch_size, state_dtype,
              group_per_matrix);
  for (int step = 1; step <= 4; ++step) {
    device.Step(step);
    host.Step(step);
  }
  const auto device_params = device.Params(), host_params = host.Params();
  ASSERT_EQ(device_params.size(), host_params.size());
  for (size_t p = 0; p < device_params.size(); ++p) {
    ASSERT_EQ(std::memcmp(device_params[p].data(), host_params[p].data(),
                          device_params[p].size() * 4),
              0)
        << kShapes[p].name;
  }
  auto device_state = device.engine().ExportState();
  auto host_state = host.engine().ExportState();
  ASSERT_TRUE(device_state.ok() && host_state.ok());
  ASSERT_EQ(device_state->size(), host_state->size());
  for (const auto& [name, values] : *device_state) {
    const std::vector<float>& other = host_state->at(name);
    ASSERT_EQ(values.size(), other.size()) << name;
    EXPECT_EQ(std::memcmp(values.data(), other.data(), values.size() * 4), 0)
        << name;
  }
  EXPECT_EQ(device.engine().state_bytes(), host.engine().state_bytes());
}

// Double-buffered device momentum (MuonOptions::double_buffer_momentum: the
// momentum phase stores it, the commit swaps it in) against the commit's
// recomputation: params and state bitwise equal after four steps (the first
// measured per shape), and the second buffer reported as the momentum's
// bytes more of transient (staged) memory, the state's bytes unchanged.
void ExpectDoubleBufferedEqualsRecomputed(Backend& backend, DType state_dtype) {
  Engine recomputed(backend, StateLocation::kDevice, 2, state_dtype);
  Engine double_buffered(backend, StateLocation::kDevice, 2, state_dtype,
                         /*group_per_matrix=*/false, /*double_buffer=*/true);
  for (int step = 1; step <= 4; ++step) {
    recomputed.Step(step);
    double_buffered.Step(step);
  }
  EXPECT_EQ(double_buffered.Params(), recomputed.Params());
  auto want = recomputed.engine().ExportState();
  auto got = double_buffered.engine().ExportState();
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(*got, *want);
  int64_t momentum_bytes = 0;
  for (const Shape& s : kShapes) {
    if (s.muon) momentum_bytes += StateBytes(state_dtype, s.rows * s.cols);
  }
  EXPECT_EQ(double_buffered.engine().state_bytes(),
            recomputed.engine().state_bytes());
  EXPECT_EQ(double_buffered.engine().peak_transient_bytes(),
            recomputed.engine().peak_transient_bytes() + momentum_bytes);
}

// fp8 codes and their block scales swapped together (fp32 and bf16 state:
// grad_check_in_momentum_test, through refused and skipped steps).
TEST(StateLocationTest, DoubleBufferedFp8MomentumStepsAsRecomputedOnCpu) {
  testing::DeviceLikeCpuBackend backend;
  ExpectDoubleBufferedEqualsRecomputed(backend, DType::kFloat8E4M3);
}

TEST(StateLocationTest, DoubleBufferedMomentumStepsAsRecomputedOnCuda) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  auto gpu = MakeCudaBackend(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat8E4M3}) {
    SCOPED_TRACE(DTypeName(dtype));
    ExpectDoubleBufferedEqualsRecomputed(**gpu, dtype);
  }
}

// A device that runs out of memory at the `fail_at`-th allocation of
// `bytes` bytes (counting from 1; 0: never).
class ExhaustedAt final : public testing::DelegatingBackend {
 public:
  ExhaustedAt(int64_t bytes, int fail_at) : bytes_(bytes), fail_at_(fail_at) {}
  bool is_device() const override { return true; }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes == bytes_ && ++seen_ == fail_at_) {
      return absl::ResourceExhaustedError("out of memory (test)");
    }
    return DelegatingBackend::Allocate(bytes);
  }

 private:
  const int64_t bytes_;
  const int fail_at_;
  int seen_ = 0;
};

// An engine over one 24x40 fp32 Muon param "w" of group "g" on `backend`.
absl::Status CreateOneParamEngine(Backend& backend, bool double_buffer) {
  std::vector<float> param(24 * 40), grad(24 * 40);
  GroupConfig g;
  g.name = "g";
  g.muon.double_buffer_momentum = double_buffer;
  ParamBinding b;
  b.name = "w";
  b.full_shape = {24, 40};
  b.param = ContiguousView(param.data(), DType::kFloat32, 24, 40);
  b.grad = ContiguousView(grad.data(), DType::kFloat32, 24, 40);
  g.params.push_back(b);
  return LayerShardedMuon::Create(&backend, {g}).status();
}

// Out of memory for the momentum or for double_buffer_momentum's second
// buffer (the first and second allocations of the state's 3840 bytes): the
// engine is not created and the error names the group, the param, the buffer
// and its bytes, with the code kept.
TEST(StateLocationTest, StateOutOfMemoryNamesTheParamAndTheBuffer) {
  const int64_t bytes = 24 * 40 * 4;
  {
    ExhaustedAt backend(bytes, 1);
    const absl::Status st = CreateOneParamEngine(backend, false);
    EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
    EXPECT_NE(st.message().find("group 'g' param 'w': its momentum (3840 "
                                "bytes of fp32 in device memory) could not be "
                                "allocated: out of memory (test)"),
              std::string::npos)
        << st;
  }
  {
    ExhaustedAt backend(bytes, 2);
    const absl::Status st = CreateOneParamEngine(backend, true);
    EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
    EXPECT_NE(st.message().find("group 'g' param 'w': its second momentum "
                                "buffer (double_buffer_momentum"),
              std::string::npos)
        << st;
  }
  // With memory enough (no allocation refused) the same engine is created.
  ExhaustedAt backend(bytes, /*fail_at=*/0);
  EXPECT_TRUE(CreateOneParamEngine(backend, true).ok());
}

TEST(StateLocationTest, HostStateStepsAsDeviceStateOnCpu) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  ExpectHostStateEqualsDeviceState(*cpu);
}

// The streamed path's pieces, slots, copies, in-place kernel and NS chunk
// order, on the CPU: one group and a group per matrix (one lane's slots),
// fp32 and fp8 state (codes and scales), NS batches of 1 and 2. One case per
// combination, so that the test's shards split them (each takes ~40 s on a
// loaded 2-core machine).
class StreamedHostStateTest
    : public ::testing::TestWithParam<std::tuple<bool, DType, int64_t>> {};

TEST_P(StreamedHostStateTest, StepsAsDeviceStateOnCpu) {
  const auto [per_matrix, dtype, batch] = GetParam();
  StreamingCpuBackend backend;
  ExpectHostStateEqualsDeviceState(backend, batch, dtype, per_matrix);
  // The host engine's lane made its load and store streams.
  EXPECT_EQ(backend.streams_made, 2);
}

INSTANTIATE_TEST_SUITE_P(
    Combinations, StreamedHostStateTest,
    ::testing::Combine(::testing::Bool(),
                       ::testing::Values(DType::kFloat32, DType::kFloat8E4M3),
                       ::testing::Values(int64_t{1}, int64_t{2})),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) ? "PerMatrix" : "OneGroup") +
             (std::get<1>(info.param) == DType::kFloat32 ? "Fp32" : "Fp8") +
             "Batch" + std::to_string(std::get<2>(info.param));
    });

// A NorMuon or AdaMuon group whose host momentum streams with its NS (one
// rank, unmeasured steps) still renormalises its update after NS: its params
// after 4 steps equal those of the same group with device state, bitwise.
std::vector<float> VariantParamsAfterSteps(MuonVariant variant,
                                           StateLocation where) {
  StreamingCpuBackend backend;
  std::vector<float> p(16 * 12), g(16 * 12);
  for (size_t i = 0; i < p.size(); ++i) p[i] = float(i % 7) / 7 - 0.4f;
  GroupConfig c;
  c.name = "m";
  c.muon.lr = 0.02;
  c.muon.variant = variant;
  c.muon.state_location = where;
  ParamBinding b;
  b.name = "w";
  b.full_shape = {16, 12};
  b.param = ContiguousView(p.data(), DType::kFloat32, 16, 12);
  b.grad = ContiguousView(g.data(), DType::kFloat32, 16, 12);
  c.params.push_back(b);
  StepOptions options;
  options.ns_shape_timing_every = 0;  // every step streams NS
  auto engine = LayerShardedMuon::Create(&backend, {c}, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  for (int step = 1; step <= 4; ++step) {
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = float((i * 13 + step * 5) % 11) / 11 - 0.5f;
    }
    const auto result = (*engine)->Step({});
    EXPECT_TRUE(result.ok()) << result.status();
  }
  return p;
}

TEST(StateLocationTest, StreamedHostStateRunsTheVariantPhase) {
  for (MuonVariant v : {MuonVariant::kNorMuon, MuonVariant::kAdaMuon}) {
    SCOPED_TRACE(MuonVariantName(v));
    const std::vector<float> device =
        VariantParamsAfterSteps(v, StateLocation::kDevice);
    ASSERT_FALSE(device.empty());
    EXPECT_EQ(VariantParamsAfterSteps(v, StateLocation::kHost), device);
  }
}

TEST(StateLocationTest, HostStateStepsAsDeviceStateOnCuda) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  auto gpu = MakeCudaBackend(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ExpectHostStateEqualsDeviceState(**gpu);
}

TEST(StateLocationTest, HostStateStepsAsDeviceStateOnCudaBatched) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  auto gpu = MakeCudaBackend(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ExpectHostStateEqualsDeviceState(**gpu, /*ns_batch_size=*/2);
}

TEST(StateLocationTest, HostFp8StateStepsAsDeviceStateOnCpu) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  ExpectHostStateEqualsDeviceState(*cpu, 1, DType::kFloat8E4M3);
}

// fp8 codes and their block scales streamed together.
TEST(StateLocationTest, HostFp8StateStepsAsDeviceStateOnCuda) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  auto gpu = MakeCudaBackend(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ExpectHostStateEqualsDeviceState(**gpu, 2, DType::kFloat8E4M3);
}

// Groups of one lane share its two slots: per-matrix groups step as one
// group does.
TEST(StateLocationTest, HostStateOfManyGroupsStepsAsDeviceStateOnCuda) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  auto gpu = MakeCudaBackend(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  ExpectHostStateEqualsDeviceState(**gpu, 1, DType::kFloat32,
                                   /*group_per_matrix=*/true);
}

// The device memory an engine takes with its state on the device and on the
// host, one group or a group per matrix.
void ExpectHostStateTakesNoDeviceMemory(bool group_per_matrix) {
  auto gpu = MakeCudaBackend(0);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  int64_t momentum_bytes = 0, largest = 0;
  for (const Shape& s : kShapes) {
    if (!s.muon) continue;
    momentum_bytes += s.rows * s.cols * 4;
    largest = std::max<int64_t>(largest, s.rows * s.cols * 4);
  }
  int64_t device_taken = 0, host_taken = 0, device_saves = 0, slots = 0,
          device_state = 0;
  {
    Engine device(**gpu, StateLocation::kDevice, 1, DType::kFloat32,
                  group_per_matrix);
    device_taken = device.device_bytes_taken();
    device_state = device.engine().state_bytes();
    // The state in device memory (and the variants' staging: none here).
    device_saves =
        device.engine().state_bytes() + device.engine().peak_transient_bytes();
  }
  {
    Engine host(**gpu, StateLocation::kHost, 1, DType::kFloat32,
                group_per_matrix);
    host_taken = host.device_bytes_taken();
    // What host state keeps on the device: the lane's two slots.
    slots = host.engine().peak_transient_bytes();
  }
  // Two slots of a piece (1/32 of a group's momentum) and the largest param,
  // however many groups share them.
  EXPECT_LE(slots, 2 * (momentum_bytes / 32 + largest + 512));
  // What host state adds on the device beside its slots: the two copy
  // streams' backends (NewStream), measured here. cudaMemGetInfo counts in
  // 2 MiB pages, so each of the two slots takes whole pages; hence the
  // rounding and the margin.
  int64_t streams = 0;
  {
    absl::StatusOr<MemoryInfo> before = (*gpu)->Memory();
    auto load = (*gpu)->NewStream(), store = (*gpu)->NewStream();
    absl::StatusOr<MemoryInfo> after = (*gpu)->Memory();
    ASSERT_TRUE(load.ok() && store.ok() && before.ok() && after.ok());
    streams = before->free_bytes - after->free_bytes;
  }
  constexpr int64_t kPage = int64_t(2) << 20;
  const int64_t slot_pages = 2 * ((slots / 2 + kPage - 1) / kPage) * kPage;
  // Device state is the momentum once: the NS inputs (bf16 at the default
  // medium precision) beside it, no staged second copy (which would add
  // momentum_bytes), within 3/4 of the momentum for the small allocations'
  // pages (an H100 measured 32 MiB: 16 state, 8 NS inputs, 8 small ones).
  EXPECT_LE(device_taken,
            device_state + momentum_bytes / 2 + momentum_bytes * 3 / 4)
      << "device engine took " << device_taken << " bytes; state "
      << device_state << ", momentum " << momentum_bytes;
  // Host state saves the state less its slots and streams: here about
  // nothing (two slots hold the largest param, a quarter of the momentum), so
  // within two pages of the allocations' rounding (an H100 measured 32 MiB
  // for both engines).
  EXPECT_GE(device_taken - host_taken,
            (device_saves - slot_pages - streams) * 9 / 10 - 2 * kPage)
      << "device engine took " << device_taken << " bytes, host engine "
      << host_taken << "; state and staging " << device_saves << ", host slots "
      << slots << " (" << slot_pages << " in pages), copy streams " << streams;
}

TEST(StateLocationTest, HostStateTakesNoDeviceMemory) {
  if (!muond::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device";
  ExpectHostStateTakesNoDeviceMemory(/*group_per_matrix=*/false);
  ExpectHostStateTakesNoDeviceMemory(/*group_per_matrix=*/true);
}

}  // namespace
}  // namespace muond
