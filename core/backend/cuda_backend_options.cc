#include "core/backend/cuda_backend_options.h"

#include <cstdlib>
#include <string_view>

namespace muond {

std::optional<SymGemmSchedule> ParseSymGemmSchedule(std::string_view name) {
  for (SymGemmSchedule s :
       {SymGemmSchedule::kAuto, SymGemmSchedule::kCooperative,
        SymGemmSchedule::kPingpong, SymGemmSchedule::kWide}) {
    if (name == SymGemmScheduleName(s)) return s;
  }
  return std::nullopt;
}

const char* SymGemmScheduleName(SymGemmSchedule schedule) {
  switch (schedule) {
    case SymGemmSchedule::kCooperative:
      return "cooperative";
    case SymGemmSchedule::kPingpong:
      return "pingpong";
    case SymGemmSchedule::kWide:
      return "wide";
    case SymGemmSchedule::kAuto:
      break;
  }
  return "auto";
}

CudaBackendOptions CudaBackendOptionsFromLegacyEnvironment(
    const std::function<const char*(const char*)>& lookup) {
  CudaBackendOptions options;
  if (const char* gemmex = lookup("MUOND_CUBLAS_GEMMEX")) {
    options.cublas_gemmex = std::string_view(gemmex) == "1";
  }
  if (const char* graphs = lookup("MUOND_CUDA_GRAPHS")) {
    options.cuda_graphs = std::string_view(graphs) != "0";
  }
  if (const char* tune = lookup("MUOND_LT_AUTOTUNE")) {
    options.lt_autotune = std::atoi(tune);
  }
  return options;
}

}  // namespace muond
