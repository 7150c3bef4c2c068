// Runs ReexecWithBetterOpenBlasCore as a program's main does, then prints
// the OpenBLAS kernels it ends up with, their description and its process
// name, a line each (for openblas_core_test).
#include <cstdio>

#include "core/backend/openblas_core.h"

int main(int, char** argv) {
  muond::ReexecWithBetterOpenBlasCore(argv);
  std::printf("%s\n%s\n", muond::OpenBlasCore().c_str(),
              muond::DescribeOpenBlasKernels().c_str());
  // Then its process name (ps, pgrep), as the image it ends up in has it.
  char name[64] = {0};
  if (FILE* comm = std::fopen("/proc/self/comm", "r")) {
    if (std::fgets(name, sizeof(name), comm) == nullptr) name[0] = '\0';
    std::fclose(comm);
  }
  std::printf("%s", name);
  return 0;
}
