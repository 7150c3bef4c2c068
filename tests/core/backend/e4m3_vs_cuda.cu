// CompareE4M3WithCuda (e4m3_vs_cuda.h): all 2^32 fp32 values and all 256
// codes through ew::FloatToE4M3 / ew::E4M3ToFloat and through cuda_fp8.h.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "core/backend/elementwise_math.h"
#include "tests/core/backend/e4m3_vs_cuda.h"

namespace muond::testing {
namespace {

struct Counts {
  unsigned long long encode;
  unsigned first_bits;
  unsigned decode;
};

__device__ bool IsNaNCode(unsigned c) { return (c & 0x7fu) == 0x7fu; }

__global__ void CompareEncode(Counts* counts) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t k = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
       k < (uint64_t(1) << 32); k += stride) {
    const float x = __uint_as_float(uint32_t(k));
    const unsigned ours = ew::FloatToE4M3(x);
    const unsigned cuda = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    const bool same =
        x != x ? IsNaNCode(ours) && IsNaNCode(cuda) : ours == cuda;
    if (!same && atomicAdd(&counts->encode, 1ull) == 0) {
      counts->first_bits = uint32_t(k);
    }
  }
}

__global__ void CompareDecode(Counts* counts) {
  const unsigned c = threadIdx.x;
  const __half_raw raw =
      __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(c), __NV_E4M3);
  const float cuda = __half2float(__half(raw));
  const float ours = ew::E4M3ToFloat(uint8_t(c));
  const bool same = cuda != cuda
                        ? ours != ours
                        : __float_as_uint(cuda) == __float_as_uint(ours);
  if (!same) atomicAdd(&counts->decode, 1u);
}

}  // namespace

E4M3Mismatches CompareE4M3WithCuda() {
  E4M3Mismatches out;
  Counts* counts = nullptr;
  cudaError_t err = cudaMalloc(&counts, sizeof(Counts));
  if (err == cudaSuccess) err = cudaMemset(counts, 0, sizeof(Counts));
  if (err == cudaSuccess) {
    CompareEncode<<<4096, 256>>>(counts);
    CompareDecode<<<1, 256>>>(counts);
    err = cudaGetLastError();
  }
  Counts host{};
  if (err == cudaSuccess) {
    err = cudaMemcpy(&host, counts, sizeof(Counts), cudaMemcpyDeviceToHost);
  }
  cudaFree(counts);
  out.encode = host.encode;
  out.first_bits = host.first_bits;
  out.decode = host.decode;
  out.error = int(err);
  return out;
}

}  // namespace muond::testing
