// StepInputs::grads_ready_event: a device lane waits for the trainer's event
// before the step's first read of a grad (and only then reads them); a
// failed wait refuses the step with nothing applied and no grad read; no
// event, no wait; a host lane is never asked to wait. The steps' results
// are bitwise those of the same engine without the event.
//
// The device is the CPU backend's math on a backend that calls itself one
// and logs, in order, its waits and its calls that read a grad.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

class Logging final : public testing::DelegatingBackend {
 public:
  explicit Logging(bool device) : device_(device) {}
  bool is_device() const override { return device_; }
  absl::Status WaitForEvent(void* event) override {
    log.push_back(absl::StrCat("wait ", reinterpret_cast<uintptr_t>(event)));
    return wait_status;
  }
  absl::StatusOr<bool> AllFiniteBelow(absl::Span<const MatrixView> views,
                                      float limit) override {
    log.push_back("read grads");
    return DelegatingBackend::AllFiniteBelow(views, limit);
  }
  absl::Status MuonMomentumBatch(
      absl::Span<const MatrixView> grads,
      absl::Span<const MatrixView> momenta_in,
      absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
      absl::Span<const MatrixView> outs,
      absl::Span<const BlockScales> scales) override {
    log.push_back("read grads");
    return DelegatingBackend::MuonMomentumBatch(grads, momenta_in, momenta_out,
                                                beta, nesterov, outs, scales);
  }
  absl::Status MuonMomentum(const MatrixView& g, const MatrixView& m_in,
                            const MatrixView& m_out, double beta, bool nesterov,
                            const MatrixView& out,
                            const BlockScales& scales) override {
    log.push_back("read grads");
    return DelegatingBackend::MuonMomentum(g, m_in, m_out, beta, nesterov, out,
                                           scales);
  }
  std::vector<std::string> log;
  absl::Status wait_status;

 private:
  const bool device_;
};

// One Muon group of two params, stepped with grads that change per step.
class Model {
 public:
  explicit Model(Backend* backend) {
    GroupConfig group;
    group.name = "muon";
    group.muon.lr = 0.02;
    for (int p = 0; p < 2; ++p) {
      values_[p].resize(kRows * kCols);
      grads_[p].resize(kRows * kCols);
      for (int64_t i = 0; i < kRows * kCols; ++i) {
        values_[p][i] = float((p * 13 + i * 7) % 29) / 29.0f - 0.5f;
      }
      ParamBinding b;
      b.name = absl::StrCat("w", p);
      b.full_shape = {kRows, kCols};
      b.param =
          ContiguousView(values_[p].data(), DType::kFloat32, kRows, kCols);
      b.grad = ContiguousView(grads_[p].data(), DType::kFloat32, kRows, kCols);
      group.params.push_back(b);
    }
    auto created = LayerShardedMuon::Create(backend, {group});
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) engine_ = std::move(*created);
  }

  absl::StatusOr<StepResult> Step(int step, void* event) {
    for (int p = 0; p < 2; ++p) {
      for (int64_t i = 0; i < kRows * kCols; ++i) {
        grads_[p][i] = float((p * 5 + step * 11 + i * 3) % 31) / 31.0f - 0.5f;
      }
    }
    StepInputs inputs;
    inputs.step_id = step;
    inputs.grads_ready_event = event;
    return engine_->RunStep(inputs);
  }
  std::vector<std::vector<float>> Values() const {
    return {values_[0], values_[1]};
  }

 private:
  static constexpr int64_t kRows = 12, kCols = 20;
  std::vector<float> values_[2], grads_[2];
  std::unique_ptr<LayerShardedMuon> engine_;
};

int event_storage = 0;
void* const kEvent = &event_storage;
const std::string kWait =
    absl::StrCat("wait ", reinterpret_cast<uintptr_t>(kEvent));

TEST(GradsReadyEventTest, ADeviceLaneWaitsBeforeItReadsAGrad) {
  Logging device(/*device=*/true), reference(/*device=*/true);
  Model with_event(&device), without(&reference);
  for (int step = 1; step <= 3; ++step) {
    device.log.clear();
    ASSERT_TRUE(with_event.Step(step, kEvent).ok());
    ASSERT_TRUE(without.Step(step, nullptr).ok());
    ASSERT_GE(device.log.size(), 2u);
    EXPECT_EQ(device.log[0], kWait) << "step " << step;
    int waits = 0;
    for (const std::string& entry : device.log) waits += entry == kWait;
    EXPECT_EQ(waits, 1) << "step " << step;
    EXPECT_EQ(device.log[1], "read grads") << "step " << step;
    // The wait changes no arithmetic.
    EXPECT_EQ(with_event.Values(), without.Values()) << "step " << step;
  }
  for (const std::string& entry : reference.log) {
    EXPECT_EQ(entry.rfind("wait", 0), std::string::npos) << entry;
  }
}

TEST(GradsReadyEventTest, AFailedWaitRefusesTheStepAndReadsNoGrad) {
  Logging device(/*device=*/true);
  Model model(&device);
  ASSERT_TRUE(model.Step(1, kEvent).ok());
  const auto before = model.Values();
  device.log.clear();
  device.wait_status = absl::InternalError("cudaStreamWaitEvent: bad event");
  const absl::StatusOr<StepResult> refused = model.Step(2, kEvent);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "step 2: waiting for the trainer's grads-ready event"),
            std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("bad event"), std::string::npos)
      << refused.status();
  EXPECT_EQ(model.Values(), before);
  EXPECT_EQ(device.log, std::vector<std::string>{kWait});
  // The next step, its wait working again, applies.
  device.wait_status = absl::OkStatus();
  EXPECT_TRUE(model.Step(3, kEvent).ok());
  EXPECT_NE(model.Values(), before);
}

TEST(GradsReadyEventTest, AHostLaneIsNotAskedToWait) {
  Logging host(/*device=*/false);
  host.wait_status = absl::InternalError("a host lane was asked to wait");
  Model model(&host);
  const auto before = model.Values();
  ASSERT_TRUE(model.Step(1, kEvent).ok());
  EXPECT_NE(model.Values(), before);
  for (const std::string& entry : host.log) {
    EXPECT_EQ(entry.rfind("wait", 0), std::string::npos) << entry;
  }
}

}  // namespace
}  // namespace muond
