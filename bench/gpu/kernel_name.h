// Short, readable kernel names for per-kernel profiles (kernel_profile.cc;
// bench/gpu_step_bench.py's short_kernel_name is the same rule, so
// torch.profiler's tables line up with the CUPTI library's). CUTLASS's
// demangled names run to kilobytes, so: a leading "void " dropped,
// "(anonymous namespace)" written "{anon}", the parameter list dropped,
// template arguments kept one level deep (deeper ones as <...>), trailing
// spaces dropped, at most 160 characters (ASCII in, ASCII out).
#ifndef MUOND_BENCH_GPU_KERNEL_NAME_H_
#define MUOND_BENCH_GPU_KERNEL_NAME_H_

#include <string>

namespace muond::bench {

inline std::string ShortKernelName(std::string name) {
  if (name.rfind("void ", 0) == 0) name = name.substr(5);
  const std::string anon = "(anonymous namespace)";
  for (size_t at; (at = name.find(anon)) != std::string::npos;)
    name.replace(at, anon.size(), "{anon}");
  std::string out;
  int depth = 0;
  for (char c : name) {
    if (c == '(' && depth == 0) break;
    if (c == '<' && ++depth == 2) out += "<...>";
    if (depth <= 1) out += c;
    if (c == '>' && depth > 0) --depth;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  if (out.size() > 160) out.resize(160);
  return out.empty() ? name.substr(0, 160) : out;
}

}  // namespace muond::bench

#endif  // MUOND_BENCH_GPU_KERNEL_NAME_H_
