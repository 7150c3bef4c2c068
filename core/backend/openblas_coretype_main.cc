// Prints the OPENBLAS_CORETYPE this machine's processes should run with
// (core/backend/openblas_core.h), or nothing where OpenBLAS chose well.
#include <cstdio>

#include "core/backend/openblas_core.h"

int main() {
  std::printf("%s\n", muond::BetterOpenBlasCore().c_str());
  return 0;
}
