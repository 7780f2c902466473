// PyTorch binding of the CUDA/HIP fused Adam: groups tensors, fills the tables, launches.

#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "fused_adam.h"

namespace {

slipstream::AdamDtypes dtypes_of(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m) {
  const auto param = p.scalar_type();
  const auto grad = g.scalar_type();
  const auto state = m.scalar_type();
  if (param == at::kFloat && grad == at::kFloat && state == at::kFloat) {
    return slipstream::AdamDtypes::kF32;
  }
  TORCH_CHECK(state == at::kFloat, "fused_adam (cuda): states of ", param,
              " params must be float32, got ", state);
  if (param == at::kBFloat16 && grad == at::kBFloat16) return slipstream::AdamDtypes::kBF16;
  if (param == at::kBFloat16 && grad == at::kFloat) {
    return slipstream::AdamDtypes::kBF16WithF32Grads;
  }
  if (param == at::kHalf && grad == at::kHalf) return slipstream::AdamDtypes::kF16;
  if (param == at::kHalf && grad == at::kFloat) return slipstream::AdamDtypes::kF16WithF32Grads;
  TORCH_CHECK(false, "fused_adam (cuda): unsupported dtypes: param ", param, ", grad ", grad,
              ", state ", state, "; supported: fp32/fp32/fp32 and bf16|fp16 params with the same ",
              "or fp32 grads and fp32 states");
  return slipstream::AdamDtypes::kF32;
}

}  // namespace

void fused_adam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                double lr, double beta1, double beta2, double eps, double weight_decay,
                bool adam_w_mode, bool bias_correction, int64_t step) {
  TORCH_CHECK(params.size() == grads.size() && params.size() == exp_avgs.size() &&
                  params.size() == exp_avg_sqs.size(),
              "fused_adam (cuda): params, grads, exp_avgs and exp_avg_sqs must have equal lengths");
  TORCH_CHECK(step >= 1, "fused_adam (cuda): step must be >= 1, got ", step);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  slipstream::AdamScalars scalars{static_cast<float>(beta1),
                                  static_cast<float>(beta2),
                                  static_cast<float>(eps),
                                  static_cast<float>(weight_decay),
                                  static_cast<float>(lr / bc1),
                                  static_cast<float>(1.0 / std::sqrt(bc2)),
                                  static_cast<float>(1.0 - lr * weight_decay),
                                  adam_w_mode};
  const int64_t block_elements = slipstream::adam_block_elements();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  // One table per dtype combination, flushed every kMaxTensors tensors.
  std::vector<std::pair<slipstream::AdamDtypes, slipstream::AdamTensorTable>> open;
  auto flush = [&](slipstream::AdamDtypes dtypes, slipstream::AdamTensorTable& table) {
    if (table.count == 0) return;
    const cudaError_t error = slipstream::launch_fused_adam(dtypes, table, scalars, stream);
    TORCH_CHECK(error == cudaSuccess, "fused_adam (cuda): launch failed: ",
                cudaGetErrorString(error));
    table.count = 0;
    table.first_block[0] = 0;
  };
  for (size_t t = 0; t < params.size(); ++t) {
    const at::Tensor& p = params[t];
    for (const at::Tensor* tensor : {&p, &grads[t], &exp_avgs[t], &exp_avg_sqs[t]}) {
      TORCH_CHECK(tensor->is_cuda() && tensor->is_contiguous() && tensor->numel() == p.numel(),
                  "fused_adam (cuda): tensor ", t, " and its grad/states must be contiguous ",
                  "GPU tensors of ", p.numel(), " elements");
    }
    if (p.numel() == 0) continue;
    const auto dtypes = dtypes_of(p, grads[t], exp_avgs[t]);
    TORCH_CHECK(exp_avg_sqs[t].scalar_type() == exp_avgs[t].scalar_type(),
                "fused_adam (cuda): exp_avg and exp_avg_sq of tensor ", t, " differ in dtype");
    auto found = std::find_if(open.begin(), open.end(),
                              [&](const auto& entry) { return entry.first == dtypes; });
    if (found == open.end()) {
      slipstream::AdamTensorTable table{};
      open.emplace_back(dtypes, table);
      found = std::prev(open.end());
    }
    auto& table = found->second;
    const int64_t blocks = (p.numel() + block_elements - 1) / block_elements;
    TORCH_CHECK(table.first_block[table.count] + blocks < INT32_MAX,
                "fused_adam (cuda): tensor ", t, " is too large for one launch");
    const int slot = table.count;
    table.params[slot] = p.data_ptr();
    table.grads[slot] = grads[t].data_ptr();
    table.exp_avgs[slot] = exp_avgs[t].data_ptr();
    table.exp_avg_sqs[slot] = exp_avg_sqs[t].data_ptr();
    table.numel[slot] = p.numel();
    table.first_block[slot + 1] = table.first_block[slot] + static_cast<int>(blocks);
    table.count = slot + 1;
    if (table.count == slipstream::kMaxTensors) flush(found->first, table);
  }
  for (auto& entry : open) flush(entry.first, entry.second);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipstream fused multi-tensor Adam/AdamW for CUDA and ROCm";
  m.def("fused_adam", &fused_adam, "Adam/AdamW step over lists of GPU tensors, in place");
}
