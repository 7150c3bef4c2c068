// Soak (not a CI test): coordinator + 4 host-mode daemons (2x2) and
// the four in-process trainers of the reliability harness run N steps (default
// 10,000) on small weights; the resident set size (VmRSS) of every daemon and
// of the coordinator is sampled along the way. Prints a Markdown table; exit 1
// when a step fails or the result after N steps differs from the reference.
//   bazel run //tests/reliability:soak -- --steps=10000
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/reliability/harness.h"

ABSL_FLAG(int, steps, 10000, "steps to run");
ABSL_FLAG(int, reference_steps, 50,
          "also check the first N steps bitwise against the reference");

namespace muond::reliability {
namespace {

int64_t RssKiB(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

int Run() {
  const int steps = absl::GetFlag(FLAGS_steps);
  Cluster cluster({});
  cluster.StartAll();
  Trainers trainers(cluster, "soak");
  if (absl::Status st = trainers.RegisterAll(); !st.ok()) {
    fprintf(stderr, "register: %s\n", st.ToString().c_str());
    return 1;
  }
  const int check = absl::GetFlag(FLAGS_reference_steps);
  std::vector<int> samples = {100, 1000, steps / 2, steps};
  std::sort(samples.begin(), samples.end());
  std::vector<std::vector<int64_t>> rss;  // [sample][process]
  const absl::Time start = absl::Now();
  for (int s = 1; s <= steps; ++s) {
    if (absl::Status st = trainers.RunSteps(s, s); !st.ok()) {
      fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    if (s == check) {
      std::vector<int> grads;
      for (int i = 1; i <= check; ++i) grads.push_back(i);
      if (trainers.Shards() != trainers.ReferenceShards(grads)) {
        fprintf(stderr, "step %d differs from the reference\n", s);
        return 1;
      }
    }
    for (int sample : samples) {
      if (s != sample) continue;
      std::vector<int64_t> row;
      for (int r = 0; r < kWorld; ++r)
        row.push_back(RssKiB(cluster.daemon_pid(r)));
      row.push_back(RssKiB(cluster.coordinator_pid()));
      rss.push_back(row);
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  printf(
      "| process | RSS at step %d (KiB) | step %d | step %d | step %d | "
      "change %d -> %d |\n",
      samples[0], samples[1], samples[2], samples[3], samples[0], steps);
  printf("|---|---|---|---|---|---|\n");
  for (int p = 0; p <= kWorld; ++p) {
    const std::string name =
        p < kWorld ? absl::StrCat("muond rank ", p) : "muond-coordinator";
    printf("| %s | %ld | %ld | %ld | %ld | %+ld KiB (%+.2f%%) |\n",
           name.c_str(), long(rss[0][p]), long(rss[1][p]), long(rss[2][p]),
           long(rss[3][p]), long(rss[3][p] - rss[0][p]),
           100.0 * double(rss[3][p] - rss[0][p]) / double(rss[0][p]));
  }
  printf(
      "\n%d steps in %.1f s (%.2f ms/step); first %d steps bitwise equal to "
      "the reference\n",
      steps, seconds, 1e3 * seconds / steps, check);
  return 0;
}

}  // namespace
}  // namespace muond::reliability

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return muond::reliability::Run();
}
