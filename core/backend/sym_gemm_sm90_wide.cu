// The symmetric GEMM with CUTLASS's cooperative consumers on 128 x 256 tiles:
// both consumer warpgroups on two square tiles side by side
// (sym_gemm_sm90_kernel.cuh, WideTileOfIndex).
#include "core/backend/sym_gemm_sm90_kernel.cuh"

namespace muond {
namespace sym_gemm_sm90 {

cudaError_t RunWide(const Args& a, const Device& dev, cudaStream_t stream) {
  return LaunchOps<cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                   2 * kTile>(a, dev, stream);
}

}  // namespace sym_gemm_sm90
}  // namespace muond
