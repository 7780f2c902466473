// Interface between the CUDA/HIP fused Adam kernel and its PyTorch binding (no torch types).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace slipstream {

constexpr int kMaxTensors = 48;  // keeps the by-value kernel argument table well under 4 KiB

// Supported (param, grad, state) dtype combinations; states are fp32 except for fp32 params.
enum class AdamDtypes : int {
  kF32 = 0,               // fp32 params, fp32 grads, fp32 states
  kBF16 = 1,              // bf16 params and grads, fp32 states
  kBF16WithF32Grads = 2,  // bf16 params, fp32 grads, fp32 states
  kF16 = 3,               // fp16 params and grads, fp32 states
  kF16WithF32Grads = 4,   // fp16 params, fp32 grads, fp32 states
};

struct AdamTensorTable {
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
  void* exp_avgs[kMaxTensors];
  void* exp_avg_sqs[kMaxTensors];
  int64_t numel[kMaxTensors];
  int first_block[kMaxTensors + 1];  // prefix sums of blocks per tensor; [count] = total
  int count;
};

struct AdamScalars {
  float beta1, beta2, eps, weight_decay, step_size, inv_sqrt_bias_correction2, decay_factor;
  bool adam_w_mode;
};

// Elements one thread block updates (the unit of first_block).
int64_t adam_block_elements();

cudaError_t launch_fused_adam(AdamDtypes dtypes, const AdamTensorTable& table,
                              const AdamScalars& scalars, cudaStream_t stream);

}  // namespace slipstream
