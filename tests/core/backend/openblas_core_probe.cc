// Runs ReexecWithBetterOpenBlasCore as a program's main does, then prints
// the OpenBLAS kernels it ends up with and their description, a line each
// (for openblas_core_test).
#include <cstdio>

#include "core/backend/openblas_core.h"

int main(int, char** argv) {
  muond::ReexecWithBetterOpenBlasCore(argv);
  std::printf("%s\n%s\n", muond::OpenBlasCore().c_str(),
              muond::DescribeOpenBlasKernels().c_str());
  return 0;
}
