// The step's "every gradient is finite" check where a device backend reads
// it in the momentum kernels' pass (the momentum phase runs in the domain
// agreement: Backend::CheckedMuonMomentumBatch), against the CPU backend,
// whose check reads the grads itself: bitwise the same params and state on
// finite steps, the same refusal naming the same params, the same skip with
// skip_nonfinite, and a skipped param's grad read by neither.
//
// The device is the CPU backend's math on a backend that calls itself one;
// both backends record the grads the check reads and count the momentum
// calls.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/backend/bf16.h"
#include "core/step/layer_sharded_muon.h"
#include "tests/common/delegating_backend.h"

namespace muond {
namespace {

// The CPU backend, or (`device`) one that calls itself a device: records
// the grads the finiteness check reads (AllFiniteBelow's views, or the grads
// of the checked momentum) and counts the momentum calls of each kind.
class Recording final : public testing::DelegatingBackend {
 public:
  explicit Recording(bool device) : device_(device) {}
  bool is_device() const override { return device_; }
  absl::StatusOr<bool> AllFiniteBelow(absl::Span<const MatrixView> views,
                                      float limit) override {
    for (const MatrixView& v : views) checked_grads.insert(v.data);
    return DelegatingBackend::AllFiniteBelow(views, limit);
  }
  absl::Status MuonMomentumBatch(
      absl::Span<const MatrixView> grads,
      absl::Span<const MatrixView> momenta_in,
      absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
      absl::Span<const MatrixView> outs,
      absl::Span<const BlockScales> scales) override {
    ++unchecked;
    return DelegatingBackend::MuonMomentumBatch(grads, momenta_in, momenta_out,
                                                beta, nesterov, outs, scales);
  }
  absl::Status CheckedMuonMomentumBatch(
      absl::Span<const MatrixView> grads,
      absl::Span<const MatrixView> momenta_in,
      absl::Span<const MatrixView> momenta_out, double beta, bool nesterov,
      absl::Span<const MatrixView> outs, absl::Span<const BlockScales> scales,
      float grad_limit, int slot) override {
    ++checked;
    --unchecked;  // the default runs MuonMomentumBatch inside
    // The default's AllFiniteBelow records the grads it reads.
    in_checked_call = true;
    const absl::Status ran = Backend::CheckedMuonMomentumBatch(
        grads, momenta_in, momenta_out, beta, nesterov, outs, scales,
        grad_limit, slot);
    in_checked_call = false;
    if (ran.ok() && fail_checked_in-- == 1) {
      // Part of the way: its slot written, then the failure.
      return absl::InternalError("momentum kernel failed");
    }
    return ran;
  }
  absl::Status CheckGradsInto(absl::Span<const MatrixView> views, float limit,
                              int slot) override {
    ++checks_into;  // the default's checked momentum calls it too
    const absl::Status ran = Backend::CheckGradsInto(views, limit, slot);
    if (ran.ok() && !in_checked_call && fail_check_into-- == 1) {
      return absl::InternalError("grad check kernel failed");
    }
    return ran;
  }
  int grad_check_slots() const override { return slots; }
  absl::StatusOr<std::vector<bool>> TakeGradChecks(int n) override {
    ++takes;
    absl::StatusOr<std::vector<bool>> within = Backend::TakeGradChecks(n);
    if (fail_next_take) {
      fail_next_take = false;
      return absl::InternalError("grad check read-back failed");
    }
    return within;
  }
  absl::Status RunGraph(uint64_t key,
                        const std::function<absl::Status()>& work) override {
    ++graphs;  // NS phases run as one graph each (NsRunner::RunLists)
    if (fail_next_graph) {
      fail_next_graph = false;
      // Part of the way: the work ran, then the failure.
      if (absl::Status ran = DelegatingBackend::RunGraph(key, work);
          !ran.ok()) {
        return ran;
      }
      return absl::InternalError("NS failed part of the way");
    }
    return DelegatingBackend::RunGraph(key, work);
  }
  // With `marks`, a device queue's time marks (as CUDA events): a mark
  // follows a phase's work, so `unwaited` says that work issued since the
  // last Synchronize may still run.
  absl::StatusOr<int> TimeMark() override {
    if (!marks) return DelegatingBackend::TimeMark();
    unwaited = true;
    return made_marks++;
  }
  absl::StatusOr<double> MarkedUs(int from, int to) override {
    if (unwaited) return absl::FailedPreconditionError("read before a wait");
    return double(to - from);
  }
  void ClearTimeMarks() override { made_marks = 0; }
  absl::Status Synchronize() override {
    unwaited = false;
    return DelegatingBackend::Synchronize();
  }
  bool marks = false, unwaited = false;
  int made_marks = 0;
  bool fail_next_graph = false;
  // The checked momentum call that fails (1: the next one; 0: none), and
  // whether the next take fails.
  int fail_checked_in = 0;
  bool fail_next_take = false;
  // Likewise for a check of its own (CheckGradsInto outside a checked call).
  int fail_check_into = 0;
  bool in_checked_call = false;
  int slots = kDefaultGradCheckSlots;
  int checked = 0, unchecked = 0, graphs = 0, takes = 0, checks_into = 0;
  std::set<const void*> checked_grads;

 private:
  const bool device_;
};

struct Shape {
  int64_t rows, cols;
};
constexpr Shape kShapes[] = {{16, 24}, {24, 16}, {8, 8}};

float Value(int group, int param, int step, int64_t i) {
  return float((group * 31 + param * 17 + step * 13 + i * 7) % 97) / 97.0f -
         0.5f;
}

// Muon groups of two kinds: "fp32" (fp32 NS and state) and "medium" (bf16
// NS input and bf16 state: its grads must also stay inside the bf16 range),
// each with the same three shapes. With `copies` > 1, that many groups of
// each kind ("fp32_0", "fp32_1", ..., then "medium_0", ...), as a group per
// layer makes them. `configure`, if set, then edits each group's config.
class Model {
 public:
  Model(Backend* backend, bool skip_nonfinite, bool double_buffer = false,
        int copies = 1, std::function<void(GroupConfig&)> configure = nullptr) {
    std::vector<GroupConfig> groups(2 * copies);
    for (int g = 0; g < 2 * copies; ++g) {
      const bool medium = g >= copies;
      groups[g].name = medium ? "medium" : "fp32";
      if (copies > 1) absl::StrAppend(&groups[g].name, "_", g % copies);
      groups[g].muon.lr = 0.02;
      groups[g].muon.nesterov = true;
      groups[g].muon.double_buffer_momentum = double_buffer;
      if (medium) {
        groups[g].muon.ns.precision = MatmulPrecision::kMedium;
        groups[g].muon.state_dtype = DType::kBFloat16;
      }
      if (configure) configure(groups[g]);
      for (int p = 0; p < int(std::size(kShapes)); ++p) {
        Param& param = params_.emplace_back();
        param.group = g;
        param.index = p;
        param.name = absl::StrCat(groups[g].name, ".w", p);
        param.value.resize(kShapes[p].rows * kShapes[p].cols);
        param.grad.resize(param.value.size());
        for (size_t i = 0; i < param.value.size(); ++i) {
          param.value[i] = Value(g, p, 0, int64_t(i));
        }
      }
    }
    for (Param& param : params_) {  // params_ no longer grows
      const Shape s = kShapes[param.index];
      ParamBinding b;
      b.name = param.name;
      b.full_shape = {s.rows, s.cols};
      b.param =
          ContiguousView(param.value.data(), DType::kFloat32, s.rows, s.cols);
      b.grad =
          ContiguousView(param.grad.data(), DType::kFloat32, s.rows, s.cols);
      groups[param.group].params.push_back(b);
    }
    StepOptions options;
    options.skip_nonfinite = skip_nonfinite;
    auto created = LayerShardedMuon::Create(backend, groups, options);
    EXPECT_TRUE(created.ok()) << created.status();
    if (created.ok()) engine_ = std::move(*created);
  }

  // Step `step`'s grads, `poison` (param name -> value) put in element 5 of
  // those params, then one step skipping the params `skip` names.
  absl::StatusOr<StepResult> Step(
      int step, const std::map<std::string, float>& poison,
      std::set<std::string> skip = {},
      std::function<absl::Status()> trainer_verdict = nullptr) {
    for (Param& p : params_) {
      for (size_t i = 0; i < p.grad.size(); ++i) {
        p.grad[i] = Value(p.group + 5, p.index, step, int64_t(i));
      }
      if (auto it = poison.find(p.name); it != poison.end()) {
        p.grad[5] = it->second;
      }
    }
    StepInputs inputs;
    inputs.skip_params = std::move(skip);
    inputs.await_trainer_verdict = std::move(trainer_verdict);
    return engine_->RunStep(inputs);
  }
  std::vector<std::vector<float>> Values() const {
    std::vector<std::vector<float>> out;
    for (const Param& p : params_) out.push_back(p.value);
    return out;
  }
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const Param& p : params_) names.push_back(p.name);
    return names;
  }
  // The address of param `name`'s grad.
  const void* GradOf(const std::string& name) const {
    for (const Param& p : params_) {
      if (p.name == name) return p.grad.data();
    }
    return nullptr;
  }
  std::map<std::string, std::vector<float>> State() const {
    auto state = engine_->ExportState();
    EXPECT_TRUE(state.ok()) << state.status();
    return state.ok() ? *state : std::map<std::string, std::vector<float>>{};
  }

 private:
  struct Param {
    int group = 0, index = 0;
    std::string name;
    std::vector<float> value, grad;
  };
  std::vector<Param> params_;
  std::unique_ptr<LayerShardedMuon> engine_;
};

struct Case {
  std::string what;
  std::map<std::string, float> poison;
  std::set<std::string> skip;
};

// Both engines through the same steps; every status, param and state equal.
// With `double_buffer` the device engine double-buffers its momentum
// (MuonOptions::double_buffer_momentum): the momentum phase stores the new
// momentum and the commit swaps it in, where the CPU engine's commit
// recomputes it.
// With `copies`, that many groups of each kind (Model); `device_slots`: the
// device's grad check slots.
void RunBoth(bool skip_nonfinite, const std::vector<Case>& cases,
             std::vector<absl::StatusOr<StepResult>>* results = nullptr,
             bool double_buffer = false, int copies = 1,
             int device_slots = Backend::kDefaultGradCheckSlots) {
  Recording cpu(/*device=*/false), device(/*device=*/true);
  device.slots = device_slots;
  Model on_cpu(&cpu, skip_nonfinite, false, copies),
      on_device(&device, skip_nonfinite, double_buffer, copies);
  const int groups = 2 * copies;
  int step = 0;
  for (const Case& c : cases) {
    ++step;
    cpu.checked_grads.clear();
    device.checked_grads.clear();
    const absl::StatusOr<StepResult> want = on_cpu.Step(step, c.poison, c.skip);
    const int checked_before = device.checked;
    const int unchecked_before = device.unchecked;
    const int takes_before = device.takes;
    const absl::StatusOr<StepResult> got =
        on_device.Step(step, c.poison, c.skip);
    ASSERT_EQ(got.ok(), want.ok()) << c.what << ": " << got.status();
    if (!want.ok()) {
      EXPECT_EQ(got.status(), want.status()) << c.what;
    } else {
      EXPECT_EQ(got->skipped_nonfinite, want->skipped_nonfinite) << c.what;
    }
    EXPECT_EQ(on_device.Values(), on_cpu.Values()) << c.what;
    if (got.ok() && got->skipped_nonfinite.empty()) {
      // The phases' times are the step's wall time cut into pieces (the
      // momentum's in the agreement too), none counted twice.
      const PhaseTimings& t = got->timings;
      EXPECT_LE(t.momentum_us + t.a2a_fwd_us + t.ns_us + t.a2a_bwd_us +
                    t.dp_share_us + t.update_us,
                t.total_us)
          << c.what;
    }
    EXPECT_EQ(on_device.State(), on_cpu.State()) << c.what;
    // Each Muon group's momentum ran once, checked, in the agreement; the
    // unchecked calls are a committed step's stores of the new momentum
    // (none where it is double-buffered), one for each kind's groups: they
    // are neighbours with the same options and commit as one.
    EXPECT_EQ(device.checked - checked_before, groups) << c.what;
    const bool committed = got.ok() && got->skipped_nonfinite.empty();
    EXPECT_EQ(device.unchecked - unchecked_before,
              committed && !double_buffer ? 2 : 0)
        << c.what;
    // Every group's finding taken with one wait per device_slots groups.
    EXPECT_EQ(device.takes - takes_before,
              (groups + device_slots - 1) / device_slots)
        << c.what;
    // Every grad not skipped is checked on both; a skipped one on neither.
    for (const Model* model : {&on_cpu, &on_device}) {
      const Recording& read = model == &on_cpu ? cpu : device;
      for (const std::string& name : model->Names()) {
        EXPECT_EQ(read.checked_grads.contains(model->GradOf(name)),
                  !c.skip.contains(name))
            << c.what << ": " << name
            << (model == &on_cpu ? " cpu" : " device");
      }
    }
    if (results != nullptr) results->push_back(got);
  }
}

TEST(GradCheckInMomentum, RefusalsAndStepsMatchTheSeparateRead) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float beyond_bf16 = BitsToFloat(kBf16OverflowThresholdBits);
  std::vector<absl::StatusOr<StepResult>> results;
  RunBoth(/*skip_nonfinite=*/false,
          {{"finite", {}, {}},
           {"a NaN in fp32.w1", {{"fp32.w1", nan}}, {}},
           {"-Inf in medium.w2", {{"medium.w2", -inf}}, {}},
           {"beyond bf16 in medium.w0", {{"medium.w0", -beyond_bf16}}, {}},
           {"beyond bf16 in fp32.w0 (fp32 holds it)",
            {{"fp32.w0", beyond_bf16}},
            {}},
           {"a NaN in skipped medium.w1", {{"medium.w1", nan}}, {"medium.w1"}},
           {"finite again", {}, {}}},
          &results);
  ASSERT_EQ(results.size(), 7u);
  for (int i : {1, 2, 3}) {
    EXPECT_TRUE(absl::IsInvalidArgument(results[i].status()))
        << results[i].status();
  }
  EXPECT_NE(results[1].status().message().find("fp32/fp32.w1"),
            std::string::npos)
      << results[1].status();
  EXPECT_NE(results[3].status().message().find("beyond the bf16 range"),
            std::string::npos)
      << results[3].status();
  for (int i : {0, 4, 5, 6}) {
    EXPECT_TRUE(results[i].ok()) << i << ": " << results[i].status();
  }
}

TEST(GradCheckInMomentum, SkipNonfiniteSkipsAlike) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<absl::StatusOr<StepResult>> results;
  RunBoth(/*skip_nonfinite=*/true,
          {{"finite", {}, {}},
           {"a NaN in medium.w2", {{"medium.w2", nan}}, {}},
           {"finite again", {}, {}}},
          &results);
  ASSERT_EQ(results.size(), 3u);
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_EQ(results[1]->skipped_nonfinite,
            std::vector<std::string>{"medium/medium.w2"});
}

// Double-buffered momentum through finite, refused, skipped and
// partly skipped steps: every status, param and state as the CPU engine's,
// whose commit recomputes the momentum (a refused or skipped step swaps
// nothing in; a skipped param's momentum stays).
TEST(GradCheckInMomentum, DoubleBufferedMomentumStepsAsRecomputed) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool skip_nonfinite : {false, true}) {
    SCOPED_TRACE(skip_nonfinite ? "skip_nonfinite" : "refuse");
    std::vector<absl::StatusOr<StepResult>> results;
    RunBoth(skip_nonfinite,
            {{"finite", {}, {}},
             {"a NaN in fp32.w1", {{"fp32.w1", nan}}, {}},
             {"finite, medium.w0 skipped", {}, {"medium.w0"}},
             {"finite again", {}, {}},
             {"a NaN in medium.w2", {{"medium.w2", nan}}, {}},
             {"finite at last", {}, {}}},
            &results, /*double_buffer=*/true);
    ASSERT_EQ(results.size(), 6u);
    EXPECT_EQ(results[1].ok(), skip_nonfinite) << results[1].status();
    for (int i : {0, 2, 3, 5}) {
      EXPECT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    }
  }
}

// A CPU and a device engine after one finite step each, with the device
// engine's params and state then.
// With `copies`, that many groups of each kind (Model).
struct AfterOneStep {
  explicit AfterOneStep(int copies = 1)
      : on_cpu(&cpu, /*skip_nonfinite=*/false, false, copies),
        on_device(&device, /*skip_nonfinite=*/false, false, copies) {
    EXPECT_TRUE(on_cpu.Step(1, {}).ok());
    EXPECT_TRUE(on_device.Step(1, {}).ok());
    values = on_device.Values();
    state = on_device.State();
  }
  Recording cpu{/*device=*/false}, device{/*device=*/true};
  Model on_cpu, on_device;
  std::vector<std::vector<float>> values;
  std::map<std::string, std::vector<float>> state;
};

// Where a device's momentum ran in the agreement and NS needs no exchange,
// NS runs before the trainer's verdict (its device work fills that wait):
// a withdrawn step still applies nothing, and the step sent again is
// bitwise the CPU engine's, which runs NS after the vote.
TEST(GradCheckInMomentum, NsRunsBeforeTheVerdictAndAWithdrawalAppliesNothing) {
  AfterOneStep t;
  auto& [cpu, device, on_cpu, on_device, values, state] = t;
  int device_graphs = -1, cpu_graphs = -1;
  const int device_before = device.graphs, cpu_before = cpu.graphs;
  const absl::StatusOr<StepResult> withdrawn = on_device.Step(2, {}, {}, [&] {
    device_graphs = device.graphs - device_before;
    return absl::FailedPreconditionError("a grad moved");
  });
  EXPECT_TRUE(absl::IsAborted(withdrawn.status())) << withdrawn.status();
  EXPECT_NE(withdrawn.status().message().find("trainer withdrew"),
            std::string::npos)
      << withdrawn.status();
  EXPECT_EQ(device_graphs, 2) << "each group's NS before the verdict";
  EXPECT_EQ(on_device.Values(), values);
  EXPECT_EQ(on_device.State(), state);
  ASSERT_TRUE(on_cpu
                  .Step(2, {}, {},
                        [&] {
                          cpu_graphs = cpu.graphs - cpu_before;
                          return absl::OkStatus();
                        })
                  .ok());
  EXPECT_EQ(cpu_graphs, 0) << "a host engine's NS ran before the vote";
  ASSERT_TRUE(on_device.Step(2, {}, {}, [] { return absl::OkStatus(); }).ok());
  EXPECT_EQ(on_device.Values(), on_cpu.Values());
  EXPECT_EQ(on_device.State(), on_cpu.State());
}

// AdamW groups on a device check their grads into slots too (no momentum
// kernel reads them before the vote): four Muon and four AdamW groups take
// every finding with one wait, a NaN in an AdamW group's grad refuses the
// step naming that param, and every step is bitwise the CPU engine's, which
// reads each group's grads on its own.
TEST(GradCheckInMomentum, AdamWGroupsCheckIntoSlotsToo) {
  auto adamw_for_medium = [](GroupConfig& g) {
    if (g.name.rfind("medium", 0) != 0) return;
    g.algorithm = Algorithm::kAdamW;
    g.adamw.lr = 0.01;
  };
  Recording cpu(/*device=*/false), device(/*device=*/true);
  Model on_cpu(&cpu, false, false, /*copies=*/4, adamw_for_medium),
      on_device(&device, false, false, /*copies=*/4, adamw_for_medium);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    const char* what;
    std::map<std::string, float> poison;
    std::set<std::string> skip;
    int fail_check_into;
  };
  const Case cases[] = {
      {"finite", {}, {}, 0},
      {"a NaN in medium_2.w1", {{"medium_2.w1", nan}}, {}, 0},
      {"a NaN in skipped medium_1.w0",
       {{"medium_1.w0", nan}},
       {"medium_1.w0"},
       0},
      {"medium_1's own check fails: its own read finds the NaN in medium_1.w2",
       {{"medium_1.w2", nan}},
       {},
       2},
      {"finite again", {}, {}, 0}};
  int step = 0;
  for (const Case& c : cases) {
    ++step;
    SCOPED_TRACE(c.what);
    device.fail_check_into = c.fail_check_into;
    device.checked_grads.clear();
    const int takes = device.takes, checked = device.checked,
              into = device.checks_into;
    const std::map<std::string, float>* poison = &c.poison;
    const absl::StatusOr<StepResult> want = on_cpu.Step(step, *poison, c.skip);
    const absl::StatusOr<StepResult> got =
        on_device.Step(step, *poison, c.skip);
    ASSERT_EQ(got.ok(), want.ok()) << step << ": " << got.status();
    for (const std::string& skipped : c.skip) {
      EXPECT_FALSE(device.checked_grads.contains(on_device.GradOf(skipped)))
          << skipped << "'s grad read";
    }
    EXPECT_EQ(device.takes - takes, 1) << step;
    EXPECT_EQ(device.checked - checked, 4) << step;  // the Muon groups
    EXPECT_EQ((device.checks_into - into) - (device.checked - checked), 4)
        << step << ": the AdamW groups' own checks";
    if (!want.ok()) {
      EXPECT_EQ(got.status(), want.status()) << step;
      const std::string& bad = c.poison.begin()->first;
      EXPECT_NE(got.status().message().find(
                    absl::StrCat(bad.substr(0, bad.find('.')), "/", bad)),
                std::string::npos)
          << got.status();
    }
    EXPECT_EQ(on_device.Values(), on_cpu.Values()) << step;
    EXPECT_EQ(on_device.State(), on_cpu.State()) << step;
  }
}

// NS that fails before the vote refuses the step in this rank's ballot,
// naming the groups of its batch (the first three and how many more): it is
// not run again after the vote on an L it may have changed, and nothing is
// applied; the step sent again is bitwise the CPU engine's.
TEST(GradCheckInMomentum, NsFailingBeforeTheVoteRefusesTheStep) {
  struct Case {
    int copies;
    const char* named;
  };
  for (const Case& c :
       {Case{1, "group 'fp32'"},
        Case{4, "groups 'fp32_0', 'fp32_1', 'fp32_2' and 1 more"}}) {
    SCOPED_TRACE(c.named);
    AfterOneStep t(c.copies);
    auto& [cpu, device, on_cpu, on_device, values, state] = t;
    const int before = device.graphs;
    device.fail_next_graph = true;
    const absl::StatusOr<StepResult> failed = on_device.Step(2, {});
    EXPECT_TRUE(absl::IsInternal(failed.status())) << failed.status();
    EXPECT_NE(failed.status().message().find(absl::StrCat(
                  c.named, ": Newton-Schulz before the job vote failed")),
              std::string::npos)
        << failed.status();
    EXPECT_EQ(device.graphs - before, 1) << "NS ran again after its failure";
    EXPECT_EQ(on_device.Values(), values);
    EXPECT_EQ(on_device.State(), state);
    ASSERT_TRUE(on_cpu.Step(2, {}).ok());
    ASSERT_TRUE(on_device.Step(2, {}).ok());
    EXPECT_EQ(on_device.Values(), on_cpu.Values());
    EXPECT_EQ(on_device.State(), on_cpu.State());
  }
}

// On a device that times phases by marks (no wait after each), every step
// still ends with its work waited for: a committed step at its commit, a
// step refused or withdrawn after NS before the vote before it answers;
// params and state as the CPU engine's throughout, and the phase times read
// after the wait.
TEST(GradCheckInMomentum, AStepWithMarkedPhasesEndsWithItsWorkWaitedFor) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Recording cpu(/*device=*/false), device(/*device=*/true);
  device.marks = true;
  Model on_cpu(&cpu, /*skip_nonfinite=*/false),
      on_device(&device, /*skip_nonfinite=*/false);
  auto go = [] { return absl::OkStatus(); };
  auto withdraw = [] { return absl::FailedPreconditionError("a grad moved"); };
  struct Case {
    const char* what;
    std::map<std::string, float> poison;
    std::function<absl::Status()> verdict;
    bool applied;
  };
  const Case cases[] = {{"finite", {}, go, true},
                        {"withdrawn after NS", {}, withdraw, false},
                        {"a NaN in fp32.w1", {{"fp32.w1", nan}}, go, false},
                        {"sent again", {}, go, true}};
  int step = 0;
  for (const Case& c : cases) {
    ++step;
    const absl::StatusOr<StepResult> got =
        on_device.Step(step, c.poison, {}, c.verdict);
    EXPECT_EQ(got.ok(), c.applied) << c.what << ": " << got.status();
    EXPECT_FALSE(device.unwaited) << c.what << ": work left running";
    if (c.applied) {
      ASSERT_TRUE(on_cpu.Step(step, c.poison).ok()) << c.what;
      EXPECT_GT(got->timings.ns_us, 0) << c.what << ": NS untimed";
    } else {
      --step;  // sent again with the same grads
    }
    EXPECT_EQ(on_device.Values(), on_cpu.Values()) << c.what;
    EXPECT_EQ(on_device.State(), on_cpu.State()) << c.what;
  }
  EXPECT_GT(device.made_marks, 0);
}

// A group per layer: four groups of each kind on one device. Every group's
// grad check is read in its momentum pass and all of them taken with one
// wait (or one per grad_check_slots() groups); a bad grad in one group
// names that param alone, in the group it is in, whichever round of slots
// took it; every status, param and state is the CPU engine's, which checks
// the groups one by one.
TEST(GradCheckInMomentum, ManyGroupsTakeTheirFindingsTogether) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float beyond_bf16 = BitsToFloat(kBf16OverflowThresholdBits);
  for (int slots : {Backend::kDefaultGradCheckSlots, 3}) {
    SCOPED_TRACE(absl::StrCat(slots, " slots"));
    std::vector<absl::StatusOr<StepResult>> results;
    RunBoth(/*skip_nonfinite=*/false,
            {{"finite", {}, {}},
             {"a NaN in fp32_2.w1", {{"fp32_2.w1", nan}}, {}},
             {"beyond bf16 in medium_3.w0", {{"medium_3.w0", beyond_bf16}}, {}},
             {"a NaN in skipped medium_1.w2",
              {{"medium_1.w2", nan}},
              {"medium_1.w2"}},
             {"finite again", {}, {}}},
            &results, /*double_buffer=*/false, /*copies=*/4, slots);
    ASSERT_EQ(results.size(), 5u);
    for (int i : {0, 3, 4}) {
      EXPECT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    }
    const std::string nan_refusal(results[1].status().message());
    EXPECT_NE(nan_refusal.find("fp32_2/fp32_2.w1"), std::string::npos)
        << nan_refusal;
    EXPECT_EQ(nan_refusal.find("fp32_1"), std::string::npos) << nan_refusal;
    EXPECT_EQ(nan_refusal.find("fp32_3"), std::string::npos) << nan_refusal;
    EXPECT_NE(results[2].status().message().find("medium_3/medium_3.w0"),
              std::string::npos)
        << results[2].status();
    results.clear();
    RunBoth(/*skip_nonfinite=*/true,
            {{"a NaN in medium_3.w2", {{"medium_3.w2", nan}}, {}},
             {"finite", {}, {}}},
            &results, /*double_buffer=*/false, /*copies=*/4, slots);
    ASSERT_EQ(results.size(), 2u);
    ASSERT_TRUE(results[0].ok()) << results[0].status();
    EXPECT_EQ(results[0]->skipped_nonfinite,
              std::vector<std::string>{"medium_3/medium_3.w2"});
  }
}

// NS before the vote runs a lane's groups together where they share an NS
// runner and NS options: four groups of each kind run as two graphs (one per
// work dtype), not eight, and a group with NS options of its own (num_steps)
// or a batch size of its own in a graph of its own; params and state are
// bitwise the CPU engine's, which runs each group's NS on its own after the
// vote.
TEST(GradCheckInMomentum, NsBeforeTheVoteRunsTheLanesGroupsTogether) {
  enum Own { kNone, kNumSteps, kBatchSize };
  for (Own own : {kNone, kNumSteps, kBatchSize}) {
    const bool own_options = own != kNone;
    SCOPED_TRACE(own == kNone       ? "same options"
                 : own == kNumSteps ? "fp32_1 with 4 NS steps"
                                    : "fp32_1 with ns_batch_size 2");
    auto configure = [&](GroupConfig& g) {
      if (g.name != "fp32_1") return;
      if (own == kNumSteps) g.muon.ns.num_steps = 4;
      if (own == kBatchSize) g.muon.ns_batch_size = 2;
    };
    Recording cpu(/*device=*/false), device(/*device=*/true);
    Model on_cpu(&cpu, false, false, /*copies=*/4, configure),
        on_device(&device, false, false, /*copies=*/4, configure);
    // The first step measures NS per shape, after the vote.
    ASSERT_TRUE(on_cpu.Step(1, {}).ok());
    ASSERT_TRUE(on_device.Step(1, {}).ok());
    for (int step = 2; step <= 4; ++step) {
      int graphs_before_verdict = -1;
      const int before = device.graphs;
      ASSERT_TRUE(on_device
                      .Step(step, {}, {},
                            [&] {
                              graphs_before_verdict = device.graphs - before;
                              return absl::OkStatus();
                            })
                      .ok());
      EXPECT_EQ(graphs_before_verdict, own_options ? 3 : 2) << step;
      EXPECT_EQ(device.graphs - before, graphs_before_verdict)
          << step << ": NS ran again after the vote";
      ASSERT_TRUE(on_cpu.Step(step, {}).ok());
      EXPECT_EQ(on_device.Values(), on_cpu.Values()) << step;
      EXPECT_EQ(on_device.State(), on_cpu.State()) << step;
    }
  }
}

// A group's checked momentum call that fails (its slot written part of the
// way), or a take that fails, costs that group's (or those groups') finding
// from the slots: each reads its grads itself and runs its momentum again
// after the vote, the others keep theirs; every step is bitwise the CPU
// engine's.
TEST(GradCheckInMomentum, AFailedCheckedCallOrTakeFallsBackToItsOwnRead) {
  Recording cpu(/*device=*/false), device(/*device=*/true);
  Model on_cpu(&cpu, false, false, /*copies=*/4),
      on_device(&device, false, false, /*copies=*/4);
  constexpr int kGroupsHere = 8;
  struct Case {
    const char* what;
    int fail_checked_in;
    bool fail_take;
    int momentum_again;  // groups whose momentum runs again after the vote
  };
  const Case cases[] = {{"finite", 0, false, 0},
                        {"fp32_2's checked call fails", 3, false, 1},
                        {"the take fails", 0, true, kGroupsHere},
                        {"finite again", 0, false, 0}};
  int step = 0;
  for (const Case& c : cases) {
    ++step;
    device.fail_checked_in = c.fail_checked_in;
    device.fail_next_take = c.fail_take;
    const int unchecked_before = device.unchecked;
    const absl::StatusOr<StepResult> got = on_device.Step(step, {});
    ASSERT_TRUE(got.ok()) << c.what << ": " << got.status();
    ASSERT_TRUE(on_cpu.Step(step, {}).ok()) << c.what;
    // The committed step's stores of the new momentum (one for each kind's
    // groups, which commit as one), and the momentum phases run again.
    EXPECT_EQ(device.unchecked - unchecked_before, 2 + c.momentum_again)
        << c.what;
    EXPECT_EQ(on_device.Values(), on_cpu.Values()) << c.what;
    EXPECT_EQ(on_device.State(), on_cpu.State()) << c.what;
  }
}

}  // namespace
}  // namespace muond
