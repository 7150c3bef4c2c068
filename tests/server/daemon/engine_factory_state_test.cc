// The daemon's engine factory builds each group's optimizer state in the
// dtype and location its wire hyperparameters ask for (state_dtype auto:
// torch's rule from the bound params' dtypes), and the engine reports the
// bytes by location and dtype as GetStatus and the metrics carry them. The
// expected bytes are computed here from the shapes: per param shard, its
// elements times the dtype's size (fp8 e4m3: one byte each plus an fp32
// scale per started block of 256), Muon one momentum, AdamW two moments,
// NorMuon's fp32 second moment one value per row, in device memory whatever
// the group's location.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/kv_store.h"
#include "server/common/proto_convert.h"
#include "server/daemon/engine_factory.h"
#include "tests/common/muon_group.h"

namespace muond {
namespace {

using Storage = std::pair<StateLocation, DType>;

struct TestParam {
  std::string name;
  int64_t rows, cols;  // rows 1: a 1-D (AdamW) param of `cols` elements
  DType dtype;
};

struct TestGroup {
  std::string name;
  bool adamw = false;
  v1::StateDType state_dtype = v1::STATE_DTYPE_UNSPECIFIED;
  v1::StateLocation state_location = v1::STATE_LOCATION_UNSPECIFIED;
  v1::MuonVariant variant = v1::MUON_VARIANT_UNSPECIFIED;
  std::vector<TestParam> params;
  // What the test expects the group's state to be (auto resolved by hand).
  StateLocation location = StateLocation::kDevice;
  DType dtype = DType::kFloat32;
};

int64_t ElementSize(DType d) {
  return d == DType::kFloat32 ? 4 : d == DType::kFloat8E4M3 ? 1 : 2;
}

// One state tensor of `n` elements in `dtype`.
int64_t TensorBytes(DType dtype, int64_t n) {
  const int64_t scales = dtype == DType::kFloat8E4M3 ? (n + 255) / 256 : 0;
  return n * ElementSize(dtype) + 4 * scales;
}

std::map<Storage, int64_t> ExpectedBytes(const std::vector<TestGroup>& groups) {
  std::map<Storage, int64_t> want;
  for (const TestGroup& g : groups) {
    for (const TestParam& p : g.params) {
      const int64_t n = p.rows * p.cols;
      want[{g.location, g.dtype}] +=
          (g.adamw ? 2 : 1) * TensorBytes(g.dtype, n);
      if (g.variant == v1::MUON_VARIANT_NORMUON) {
        want[{StateLocation::kDevice, DType::kFloat32}] += 4 * p.rows;
      }
    }
  }
  return want;
}

// The groups bound over zeroed memory (each param's param and grad buffers
// kept in `memory`), as RegisterParams leaves them: params cleared from the
// proto.
class Bound {
 public:
  explicit Bound(const std::vector<TestGroup>& groups) {
    for (const TestGroup& g : groups) {
      BoundGroup bound;
      bound.proto = testing::DenseMuonGroup(1, 1, 0, 0);
      bound.proto.set_name(g.name);
      if (g.adamw) {
        bound.proto.set_algorithm(v1::ALGORITHM_ADAMW);
        bound.proto.mutable_adamw()->set_lr(1e-3);
        bound.proto.mutable_adamw()->set_state_dtype(g.state_dtype);
        bound.proto.mutable_adamw()->set_state_location(g.state_location);
      } else {
        bound.proto.mutable_muon()->set_state_dtype(g.state_dtype);
        bound.proto.mutable_muon()->set_state_location(g.state_location);
        bound.proto.mutable_muon()->set_variant(g.variant);
      }
      for (const TestParam& p : g.params) bound.params.push_back(Bind(p));
      reg.groups.push_back(std::move(bound));
    }
  }

  Registration reg;

 private:
  BoundParam Bind(const TestParam& p) {
    BoundParam b;
    b.name = p.name;
    b.full_shape = p.rows == 1 ? std::vector<int64_t>{p.cols}
                               : std::vector<int64_t>{p.rows, p.cols};
    b.local_shape = b.full_shape;
    const size_t bytes = p.rows * p.cols * ElementSize(p.dtype);
    for (MatrixView* view : {&b.param, &b.grad}) {
      memory_.push_back(std::make_unique<std::vector<uint8_t>>(bytes, 0));
      *view = ContiguousView(memory_.back()->data(), p.dtype, p.rows, p.cols);
    }
    return b;
  }

  std::vector<std::unique_ptr<std::vector<uint8_t>>> memory_;
};

// Builds the engine of `groups` on one host-mode rank and checks its
// state_bytes_by_storage against ExpectedBytes, and that it adds up.
void ExpectStateBytes(const std::vector<TestGroup>& groups) {
  Bound bound(groups);
  EngineOptions options;
  options.job_id = "job";
  v1::Plan plan;
  plan.set_version(1);
  absl::StatusOr<std::unique_ptr<StepEngine>> engine =
      MakeEngineFactory(options, std::make_shared<InMemoryKeyValueStore>())(
          bound.reg, plan, [] { return false; });
  ASSERT_TRUE(engine.ok()) << engine.status();
  const LayerShardedMuon& muon = *(*engine)->muon;
  std::map<Storage, int64_t> got;
  int64_t total = 0;
  for (const StateStorageBytes& b : muon.state_bytes_by_storage()) {
    EXPECT_GT(b.bytes, 0) << "only pairs that hold state are listed";
    got[{b.location, b.dtype}] = b.bytes;
    total += b.bytes;
  }
  EXPECT_EQ(got, ExpectedBytes(groups));
  EXPECT_EQ(total, muon.state_bytes());
}

TEST(EngineFactoryState, AutoFollowsTheParamsAndExplicitStorageWins) {
  constexpr DType f32 = DType::kFloat32, bf16 = DType::kBFloat16;
  ExpectStateBytes({
      {.name = "auto_fp32", .params = {{"a", 8, 6, f32}, {"b", 6, 5, f32}}},
      {.name = "auto_bf16",
       .params = {{"c", 8, 6, bf16}, {"d", 5, 7, bf16}},
       .dtype = bf16},
      {.name = "mixed", .params = {{"e", 4, 6, bf16}, {"f", 6, 4, f32}}},
      {.name = "host_bf16",
       .state_dtype = v1::STATE_DTYPE_BF16,
       .state_location = v1::STATE_LOCATION_HOST,
       .params = {{"g", 7, 5, f32}},
       .location = StateLocation::kHost,
       .dtype = bf16},
      {.name = "host_fp32_of_bf16",
       .state_dtype = v1::STATE_DTYPE_FP32,
       .state_location = v1::STATE_LOCATION_HOST,
       .params = {{"h", 6, 6, bf16}},
       .location = StateLocation::kHost},
      {.name = "normuon_bf16_host",
       .state_dtype = v1::STATE_DTYPE_BF16,
       .state_location = v1::STATE_LOCATION_HOST,
       .variant = v1::MUON_VARIANT_NORMUON,
       .params = {{"i", 8, 4, f32}},
       .location = StateLocation::kHost,
       .dtype = bf16},
      {.name = "adamw_host",
       .adamw = true,
       .state_location = v1::STATE_LOCATION_HOST,
       .params = {{"j", 1, 10, f32}},
       .location = StateLocation::kHost},
  });
}

// AdamW moments follow the same rule as Muon's momentum: zeros_like(param).
TEST(EngineFactoryState, AdamWStateOfBf16ParamsIsBf16) {
  ExpectStateBytes({{.name = "adamw_bf16",
                     .adamw = true,
                     .params = {{"b", 1, 10, DType::kBFloat16}},
                     .dtype = DType::kBFloat16},
                    {.name = "adamw_bf16_host",
                     .adamw = true,
                     .state_dtype = v1::STATE_DTYPE_BF16,
                     .state_location = v1::STATE_LOCATION_HOST,
                     .params = {{"c", 1, 7, DType::kFloat32}},
                     .location = StateLocation::kHost,
                     .dtype = DType::kBFloat16}});
}

// fp8 counts its codes and one fp32 scale per started block of 256.
TEST(EngineFactoryState, Fp8StateCountsItsBlockScales) {
  constexpr DType fp8 = DType::kFloat8E4M3;
  ExpectStateBytes({{.name = "muon_fp8",
                     .state_dtype = v1::STATE_DTYPE_FP8_E4M3,
                     .params = {{"w", 24, 20, DType::kFloat32}},
                     .dtype = fp8},
                    {.name = "adamw_fp8_host",
                     .adamw = true,
                     .state_dtype = v1::STATE_DTYPE_FP8_E4M3,
                     .state_location = v1::STATE_LOCATION_HOST,
                     .params = {{"b", 1, 300, DType::kFloat32}},
                     .location = StateLocation::kHost,
                     .dtype = fp8}});
}

// GetStatus's entries: the core names of location and dtype.
TEST(EngineFactoryState, StateBytesOnTheWireNameLocationAndDType) {
  const v1::StateBytes b =
      StateBytesToProto({StateLocation::kHost, DType::kFloat8E4M3, 1234});
  EXPECT_EQ(b.location(), "host");
  EXPECT_EQ(b.dtype(), "fp8_e4m3");
  EXPECT_EQ(b.bytes(), 1234);
}

}  // namespace
}  // namespace muond
