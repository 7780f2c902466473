// Multi-tensor fused Adam/AdamW for CUDA (and ROCm, through PyTorch's hipify).
//
// Plain CUDA with no torch headers, so `nvcc -c` checks it for every architecture without a
// CUDA build of PyTorch; fused_adam_binding.cpp hands it raw pointers and the current stream.
// One launch covers up to kMaxTensors tensors (the same idea as DeepSpeed's multi_tensor_apply):
// the tensor table travels by value in the kernel arguments, and each thread block finds its
// tensor from the prefix sums of blocks per tensor.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fused_adam.h"

namespace {

constexpr int kThreads = 256;
constexpr int kElementsPerThread = 4;
constexpr int64_t kBlockElements = kThreads * kElementsPerThread;

__device__ __forceinline__ float to_float(float value) { return value; }
__device__ __forceinline__ float to_float(__half value) { return __half2float(value); }
__device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16(value);  // round to nearest even (CUDA and HIP)
}

template <typename P, typename G, typename S>
__global__ void __launch_bounds__(kThreads)
    adam_multi_tensor_kernel(slipstream::AdamTensorTable table, slipstream::AdamScalars s) {
  // Which tensor this block works on: the last one whose first block is <= blockIdx.x.
  int tensor = 0;
  while (tensor + 1 < table.count && table.first_block[tensor + 1] <= static_cast<int>(blockIdx.x)) {
    ++tensor;
  }
  const int64_t n = table.numel[tensor];
  const int64_t base = (static_cast<int64_t>(blockIdx.x) - table.first_block[tensor]) * kBlockElements;
  P* p = static_cast<P*>(table.params[tensor]);
  const G* g = static_cast<const G*>(table.grads[tensor]);
  S* m = static_cast<S*>(table.exp_avgs[tensor]);
  S* v = static_cast<S*>(table.exp_avg_sqs[tensor]);
#pragma unroll
  for (int k = 0; k < kElementsPerThread; ++k) {
    // Consecutive threads touch consecutive elements: coalesced loads and stores.
    const int64_t i = base + static_cast<int64_t>(k) * kThreads + threadIdx.x;
    if (i >= n) break;
    float grad = to_float(g[i]);
    float weight = to_float(p[i]);
    if (!s.adam_w_mode) grad += s.weight_decay * weight;  // L2 mode: the moments see the decay
    const float mi = s.beta1 * to_float(m[i]) + (1.0f - s.beta1) * grad;
    const float vi = s.beta2 * to_float(v[i]) + (1.0f - s.beta2) * grad * grad;
    // Correctly rounded sqrt and division: the result tracks the reference to fp32 rounding.
    const float denominator = __fsqrt_rn(vi) * s.inv_sqrt_bias_correction2 + s.eps;
    if (s.adam_w_mode) weight *= s.decay_factor;
    weight -= s.step_size * __fdiv_rn(mi, denominator);
    p[i] = from_float<P>(weight);
    m[i] = from_float<S>(mi);
    v[i] = from_float<S>(vi);
  }
}

template <typename P, typename G, typename S>
cudaError_t launch(const slipstream::AdamTensorTable& table, const slipstream::AdamScalars& s,
                   cudaStream_t stream) {
  const int blocks = table.first_block[table.count];
  if (blocks == 0) return cudaSuccess;
  adam_multi_tensor_kernel<P, G, S><<<blocks, kThreads, 0, stream>>>(table, s);
  return cudaGetLastError();
}

}  // namespace

namespace slipstream {

int64_t adam_block_elements() { return kBlockElements; }

cudaError_t launch_fused_adam(AdamDtypes dtypes, const AdamTensorTable& table,
                              const AdamScalars& scalars, cudaStream_t stream) {
  switch (dtypes) {
    case AdamDtypes::kF32:
      return launch<float, float, float>(table, scalars, stream);
    case AdamDtypes::kBF16:
      return launch<__nv_bfloat16, __nv_bfloat16, float>(table, scalars, stream);
    case AdamDtypes::kBF16WithF32Grads:
      return launch<__nv_bfloat16, float, float>(table, scalars, stream);
    case AdamDtypes::kF16:
      return launch<__half, __half, float>(table, scalars, stream);
    case AdamDtypes::kF16WithF32Grads:
      return launch<__half, float, float>(table, scalars, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace slipstream
