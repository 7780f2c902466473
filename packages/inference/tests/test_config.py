"""The inference config: DeepSpeed's keys, aliases, deprecated spellings and named errors."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.inference.config import InferenceConfig, load_inference_config
from slipstream.kernels.config_schema import ConfigError, NotImplementedFeatureError


def test_deepspeed_spellings() -> None:
    config = load_inference_config(
        {"tp": {"tp_size": 2}, "kernel_inject": True, "max_tokens": 256}, dtype=torch.half
    )
    assert (config.tp_size, config.replace_with_kernel_inject, config.max_out_tokens) == (
        2,
        True,
        256,
    )
    assert config.torch_dtype == torch.float16
    assert load_inference_config(None, mp_size=4).tp_size == 4
    assert load_inference_config({"dtype": "bf16"}).torch_dtype == torch.bfloat16
    int4 = load_inference_config(
        {"dtype": "int8", "quant": {"weight": {"num_bits": 4, "compute_dtype": "fp32"}}}
    )
    assert (int4.weight_bits, int4.torch_dtype) == (4, torch.float32)
    zero = load_inference_config({"zero": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert zero.zero.offload_param.device == "cpu"


def test_json_file(tmp_path) -> None:
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "enable_cuda_graph": True}))
    config = load_inference_config(str(path), replace_with_kernel_inject=True)
    assert config.enable_cuda_graph and config.torch_dtype == torch.float32


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"max_out_token": 5}, "did you mean 'max_out_tokens'"),
        ({"tensor_parallel": {"tp_sise": 2}}, "tensor_parallel.tp_size"),
        ({"tensor_parallel": {"allreduce": "nvls"}}, "tensor_parallel.allreduce"),
        ({"tensor_parallel": {"symm_mem_kernel": "nccl"}}, "tensor_parallel.symm_mem_kernel"),
        ({"dtype": "fp8"}, r"dtype = \"fp8\""),
        ({"max_out_tokens": 0}, "max_out_tokens = 0"),
        ({"max_out_tokens": 4, "min_out_tokens": 8}, "raise max_out_tokens"),
        ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, "keep only tensor_parallel.tp_size"),
        ({"zero": {"offload_param": {"device": "cpu"}}}, "zero.stage"),
        ({"zero": {"stage": 2}}, "stages 1 and 2 shard optimizer states"),
        ({"quant": {"weight": {"num_bits": 3}}}, "quant.weight.num_bits"),
        ({"quant": {"weight": {"scale_dtype": "fp8"}}}, "quant.weight.scale_dtype"),
        ({"enable_cuda_graph": "yes"}, "enable_cuda_graph"),
        ({"zero": {"stage": 3, "offload_param": {"device": "nvme"}}}, "offload_param.nvme_path"),
    ],
)
def test_bad_values_name_the_key(data, message) -> None:
    with pytest.raises(ConfigError, match=message):
        InferenceConfig.from_dict(data)


@pytest.mark.parametrize(
    "data",
    [
        {"triton_autotune": True},
        {"quant": {"weight": {"q_type": "asymmetric"}}},
        {"moe": {"ep_size": 2}},
        {"checkpoint": {"type": "ds_model", "checkpoints": []}},
        {"save_mp_checkpoint_path": "/tmp/x"},
    ],
)
def test_unimplemented_features_say_so(data) -> None:
    with pytest.raises(NotImplementedFeatureError, match="not implemented yet"):
        InferenceConfig.from_dict(data)


def test_keyword_conflicting_with_config() -> None:
    with pytest.raises(ConfigError, match="given both"):
        load_inference_config({"dtype": "fp16"}, dtype="bf16")
