// What param groups cost the layer-sharded step on the host: the same P
// small params stepped as one group and as P groups of one param (a group
// per layer taken to the end), every param GTP-sharded over R ranks (rows
// split, NS on its home rank, the exchanges and the domain agreement over
// Gloo between R threads of this process). Prints each layout's median step
// time on rank 0 and the ratio one group / P groups (1.00: groups cost
// nothing), measured side by side in one run. On the host backend this is
// the per-group host work and what the collectives cost beyond one group's
// (the domain votes and the exchanges run batched across a lane's groups);
// the device-only batching (grad check slots, NS across groups) needs a GPU
// (step_bench --engine --groups).
//   groups_bench [--ranks=2] [--params=1000] [--rows=8] [--cols=16]
//                [--steps=20] [--warmup=3]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/backend/cpu_backend.h"
#include "core/comm/gloo_communicator.h"
#include "core/comm/kv_store.h"
#include "core/step/layer_sharded_muon.h"

ABSL_FLAG(int, ranks, 2, "ranks (threads over Gloo) the params are split over");
ABSL_FLAG(int, params, 1000, "params (each rows*ranks x cols in full)");
ABSL_FLAG(int64_t, rows, 8, "rows of each param's shard on one rank");
ABSL_FLAG(int64_t, cols, 16, "cols of each param");
ABSL_FLAG(int, steps, 20, "timed steps per layout");
ABSL_FLAG(int, warmup, 3, "untimed steps first (plans, engines)");

namespace muond {
namespace {

struct Run {
  absl::Status status;
  std::vector<double> step_ms;  // rank 0's
};

// The groups of one rank: P params in `groups` groups (param i in group
// i * groups / P), bound to `values` and `grads` (P entries each, sized
// here) and GTP-sharded over `gtp`.
std::vector<GroupConfig> Groups(int rank, int groups, Communicator* gtp,
                                std::vector<std::vector<float>>& values,
                                std::vector<std::vector<float>>& grads) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int params = absl::GetFlag(FLAGS_params);
  const int64_t rows = absl::GetFlag(FLAGS_rows);
  const int64_t cols = absl::GetFlag(FLAGS_cols);
  std::vector<GroupConfig> configs(groups);
  for (int k = 0; k < groups; ++k) {
    configs[k].name = absl::StrCat("group", k);
    configs[k].muon.lr = 0.02;
    configs[k].domain.size = DomainSize{ranks, 1};
    configs[k].domain.g = rank;
    configs[k].domain.gtp = gtp;
  }
  values.assign(params, {});
  grads.assign(params, {});
  for (int i = 0; i < params; ++i) {
    values[i].assign(rows * cols, 0.01f * float((i + rank) % 7));
    grads[i].assign(rows * cols, 0.0f);
    ParamBinding b;
    b.name = absl::StrCat("w", i);
    b.full_shape = {rows * ranks, cols};
    b.tags.is_gtp_weight_remat = true;
    b.param = ContiguousView(values[i].data(), DType::kFloat32, rows, cols);
    b.grad = ContiguousView(grads[i].data(), DType::kFloat32, rows, cols);
    configs[int64_t(i) * groups / params].params.push_back(b);
  }
  return configs;
}

// One rank: P params in `groups` groups (param i in group i * groups / P).
void RunRank(KeyValueStore* store, const std::string& prefix, int rank,
             int groups, Run* run) {
  const int ranks = absl::GetFlag(FLAGS_ranks);
  const int params = absl::GetFlag(FLAGS_params);
  GlooOptions gloo;
  gloo.hostname = "127.0.0.1";
  auto gtp = CreateGlooCommunicator(store, prefix + "gtp", rank, ranks, gloo);
  auto job = CreateGlooCommunicator(store, prefix + "job", rank, ranks, gloo);
  if (!gtp.ok() || !job.ok()) {
    run->status = gtp.ok() ? job.status() : gtp.status();
    return;
  }
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<std::vector<float>> values, grads;
  const std::vector<GroupConfig> configs =
      Groups(rank, groups, gtp->get(), values, grads);
  StepOptions options;
  options.job = job->get();
  auto engine = LayerShardedMuon::Create(backend.get(), configs, options);
  if (!engine.ok()) {
    run->status = engine.status();
    return;
  }
  // Homes spread over the ranks.
  for (const GroupConfig& g : configs) {
    std::vector<NsHome> homes;
    for (size_t p = 0; p < g.params.size(); ++p) {
      homes.push_back(NsHome{0, int(p + g.name.size()) % ranks});
    }
    run->status.Update((*engine)->SetHomes(g.name, homes));
  }
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int steps = absl::GetFlag(FLAGS_steps);
  for (int s = 0; s < warmup + steps && run->status.ok(); ++s) {
    for (int i = 0; i < params; ++i) {
      std::fill(grads[i].begin(), grads[i].end(), 0.1f * float((i + s) % 5));
    }
    const absl::Time start = absl::Now();
    run->status = (*engine)->Step({}).status();
    if (s >= warmup && rank == 0) {
      run->step_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
    }
  }
}

// Rank 0's median step time with `groups` groups, or -1 on an error.
double MedianStepMs(int groups) {
  InMemoryKeyValueStore store;
  const int ranks = absl::GetFlag(FLAGS_ranks);
  std::vector<Run> runs(ranks);
  std::vector<std::thread> threads;
  const std::string prefix = absl::StrCat("g", groups, "/");
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back(RunRank, &store, prefix, r, groups, &runs[r]);
  }
  for (std::thread& t : threads) t.join();
  for (const Run& run : runs) {
    if (!run.status.ok()) {
      std::fprintf(stderr, "groups_bench: %d groups: %s\n", groups,
                   run.status.ToString().c_str());
      return -1;
    }
  }
  std::vector<double> ms = runs[0].step_ms;
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? -1 : ms[ms.size() / 2];
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int params = absl::GetFlag(FLAGS_params);
  const struct {
    const char* flag;
    int64_t value, least;
  } checks[] = {{"--ranks", absl::GetFlag(FLAGS_ranks), 1},
                {"--params", params, 1},
                {"--rows", absl::GetFlag(FLAGS_rows), 1},
                {"--cols", absl::GetFlag(FLAGS_cols), 1},
                {"--steps", absl::GetFlag(FLAGS_steps), 1},
                {"--warmup", absl::GetFlag(FLAGS_warmup), 0}};
  for (const auto& c : checks) {
    if (c.value < c.least) {
      std::fprintf(stderr, "groups_bench: %s=%lld must be >= %lld\n", c.flag,
                   (long long)c.value, (long long)c.least);
      return 2;
    }
  }
  const double one = muond::MedianStepMs(1);
  const double many = muond::MedianStepMs(params);
  if (one <= 0 || many <= 0) return 1;
  std::printf(
      "| layout | median step (ms) | one group ÷ this |\n|---|---|---|\n");
  std::printf("| %d params in one group | %.2f | 1.00 |\n", params, one);
  std::printf("| %d groups of one param | %.2f | %.2f |\n", params, many,
              one / many);
  std::printf("per group beyond the first: %.1f us\n",
              (many - one) * 1000.0 / std::max(1, params - 1));
  return 0;
}
