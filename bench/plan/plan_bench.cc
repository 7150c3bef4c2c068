// Planning benchmark: for each shipped manifest and a synthetic
// 100k-matrix MoE, at 8, 16 and 64 ranks, prints a markdown table of
//   * planning time of PlanNsHomes (median of runs; goal <= 100 ms) and of one
//     rank's BuildGroupExchangePlan,
//   * max/mean rank load of the LPT plan, side by side with the best any plan
//     could reach (lower bound / mean) and with the round-robin fallback
//     (goal: LPT <= 1.05 where the lower bound allows),
//   * the same for balancing on exact NS FLOPs, evaluated in FLOPs.
// Usage: plan_bench [--manifests DIR] [--reps N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/plan/exchange_plan.h"
#include "core/plan/manifest.h"
#include "core/plan/planner.h"
#include "core/plan/sharding.h"

namespace muond {
namespace {

Manifest SyntheticMoe() {
  // 52 layers x (4 attention + 640 experts x 3) = 100,048 matrices.
  // hidden 4096, expert FFN 1536, 64/4 heads of 128.
  Manifest m;
  m.model = "synthetic MoE 100k";
  auto add = [&](std::string name, int64_t p, int64_t q, int tp_dim) {
    m.params.push_back(
        ManifestParam{std::move(name), {p, q}, tp_dim, true, -1});
  };
  for (int l = 0; l < 52; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "q", 8192, 4096, 0);
    add(p + "k", 512, 4096, 0);
    add(p + "v", 512, 4096, 0);
    add(p + "o", 4096, 8192, 1);
    for (int e = 0; e < 640; ++e) {
      const std::string x = p + "experts." + std::to_string(e) + ".";
      add(x + "gate", 1536, 4096, -1);
      add(x + "up", 1536, 4096, -1);
      add(x + "down", 4096, 1536, -1);
    }
  }
  return m;
}

template <typename F>
double MedianMs(int reps, F&& f) {
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(
                     std::chrono::steady_clock::now() - t0)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double MeanOf(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / v.size();
}

// Max/mean of `homes` evaluated under `options`' cost model.
double MaxOverMean(const std::vector<ParamShardSpec>& specs,
                   const std::vector<NsHome>& homes, DomainSize d,
                   const PlannerOptions& options, double* lb_over_mean) {
  HomePlan p;
  p.homes = homes;
  std::vector<double> costs = *ParamCosts(specs, options);
  if (!ComputePlanLoads(specs, costs, d, p).ok()) return -1;
  if (lb_over_mean) *lb_over_mean = p.lower_bound / MeanOf(p.rank_load);
  return p.max_over_mean;
}

int Run(const std::string& dir, int reps) {
  std::vector<Manifest> workloads;
  for (const char* f :
       {"llama3_8b.json", "llama3_70b.json", "qwen3_30b_a3b.json"}) {
    absl::StatusOr<Manifest> m = LoadManifestFile(dir + "/" + f);
    if (!m.ok()) {
      std::fprintf(stderr, "%s\n", std::string(m.status().message()).c_str());
      return 1;
    }
    workloads.push_back(*std::move(m));
  }
  workloads.push_back(SyntheticMoe());
  const std::vector<DomainSize> domains = {{8, 1}, {4, 2},  {16, 1},
                                           {8, 2}, {64, 1}, {8, 8}};
  std::printf(
      "| workload | matrices | G x T | plan ms | exch. plan ms (1 rank) | "
      "LPT max/mean | LB/mean | LPT max/LB | round-robin max/mean | "
      "FLOPs-LPT max/mean (FLOPs) | ns_cost-LPT max/mean (FLOPs) |\n"
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Manifest& m : workloads) {
    for (DomainSize d : domains) {
      absl::StatusOr<std::vector<ParamShardSpec>> specs = ManifestSpecs(m, d);
      if (!specs.ok()) {
        std::fprintf(stderr, "%s\n",
                     std::string(specs.status().message()).c_str());
        return 1;
      }
      PlannerOptions ns_cost, flops;
      flops.cost = kFlops;
      absl::StatusOr<HomePlan> plan;
      const double plan_ms =
          MedianMs(reps, [&] { plan = PlanNsHomes(*specs, d, ns_cost); });
      if (!plan.ok()) return 1;
      absl::StatusOr<GroupExchangePlan> ex;
      const double ex_ms = MedianMs(reps, [&] {
        ex = BuildGroupExchangePlan(*specs, plan->homes, d, 0, 0);
      });
      if (!ex.ok()) return 1;
      HomePlan rr = RoundRobinHomes(*specs, d, ns_cost);
      absl::StatusOr<HomePlan> fplan = PlanNsHomes(*specs, d, flops);
      if (!fplan.ok()) return 1;
      double lb_mean = 0;
      MaxOverMean(*specs, plan->homes, d, ns_cost, &lb_mean);
      std::printf(
          "| %s | %zu | %d x %d | %.2f | %.2f | %.4f | %.4f | %.4f | %.4f | "
          "%.4f | %.4f |\n",
          m.model.c_str(), specs->size(), d.gtp, d.tp, plan_ms, ex_ms,
          plan->max_over_mean, lb_mean, plan->lower_bound_ratio,
          rr.max_over_mean, fplan->max_over_mean,
          MaxOverMean(*specs, plan->homes, d, flops, nullptr));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace muond

int main(int argc, char** argv) {
  std::string dir = "bench/manifests";
  int reps = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--manifests")) dir = argv[i + 1];
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
  }
  return muond::Run(dir, std::max(1, reps));
}
