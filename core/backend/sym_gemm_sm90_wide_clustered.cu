// The symmetric GEMM with CUTLASS's cooperative consumers on 128 x 256 tiles,
// in clusters of two CTAs along M that share each B panel by TMA multicast
// (sym_gemm_sm90_kernel.cuh, ClusterTileOfItem).
#include "core/backend/sym_gemm_sm90_kernel.cuh"

namespace muond {
namespace sym_gemm_sm90 {

cudaError_t RunWideClustered(const Args& a, const Device& dev,
                             cudaStream_t stream) {
  return LaunchOps<cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                   2 * kTile, kMaxClusterM>(a, dev, stream);
}

}  // namespace sym_gemm_sm90
}  // namespace muond
