// Private to the sm_90a symmetric GEMM (sym_gemm_sm90*.cu): the launchers of
// its three consumer schedules, each in its own translation unit, and what they
// need to know of the device. No CUTLASS types.
#ifndef MUOND_CORE_BACKEND_SYM_GEMM_SM90_LAUNCH_H_
#define MUOND_CORE_BACKEND_SYM_GEMM_SM90_LAUNCH_H_

#include <cuda_runtime.h>

#include "core/backend/sym_gemm_sm90.h"

namespace muond {
namespace sym_gemm_sm90 {

struct Device {
  int id = 0;
  int sm_count = 0;  // the persistent grid's size
};

// Preconditions as Run's; `a.schedule` is not read.
cudaError_t RunCooperative(const Args& a, const Device& dev,
                           cudaStream_t stream);
cudaError_t RunPingpong(const Args& a, const Device& dev, cudaStream_t stream);
cudaError_t RunWide(const Args& a, const Device& dev, cudaStream_t stream);

}  // namespace sym_gemm_sm90
}  // namespace muond

#endif  // MUOND_CORE_BACKEND_SYM_GEMM_SM90_LAUNCH_H_
