// The symmetric GEMM with CUTLASS's cooperative consumers: both consumer
// warpgroups on one 128 x 128 tile (sym_gemm_sm90_kernel.cuh).
#include "core/backend/sym_gemm_sm90_kernel.cuh"

namespace muond {
namespace sym_gemm_sm90 {

cudaError_t RunCooperative(const Args& a, const Device& dev,
                           cudaStream_t stream) {
  return LaunchOps<cutlass::gemm::KernelTmaWarpSpecializedCooperative>(a, dev,
                                                                       stream);
}

}  // namespace sym_gemm_sm90
}  // namespace muond
