// The symmetric GEMM with CUTLASS's ping-pong consumers: each consumer
// warpgroup on a 128 x 128 tile of its own, one's epilogue under the other's
// mainloop (sym_gemm_sm90_kernel.cuh).
#include "core/backend/sym_gemm_sm90_kernel.cuh"

namespace muond {
namespace sym_gemm_sm90 {

cudaError_t RunPingpong(const Args& a, const Device& dev, cudaStream_t stream) {
  return LaunchOps<cutlass::gemm::KernelTmaWarpSpecializedPingpong>(a, dev,
                                                                    stream);
}

}  // namespace sym_gemm_sm90
}  // namespace muond
