"""The inference config block: DeepSpeed's ``DeepSpeedInferenceConfig`` keys, typed and checked."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from slipstream.kernels.config_schema import (
    ConfigBlock,
    ConfigError,
    config_fail,
    key_path,
    not_implemented,
)

__all__ = [
    "DTYPE_NAMES",
    "CheckpointConfig",
    "InferenceConfig",
    "InferenceZeroConfig",
    "MoEInferenceConfig",
    "OffloadParamConfig",
    "QuantConfig",
    "TensorParallelConfig",
    "WeightQuantConfig",
    "load_inference_config",
]

# DeepSpeed's DtypeEnum spellings, each mapped to its canonical name.
DTYPE_NAMES: dict[str, str] = {
    **dict.fromkeys(("torch.float16", "fp16", "float16", "half", "torch.half"), "fp16"),
    **dict.fromkeys(("torch.float32", "fp32", "float32", "float", "torch.float"), "fp32"),
    **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16", "bfloat"), "bf16"),
    **dict.fromkeys(("torch.int8", "int8"), "int8"),
}
TORCH_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}
_NOT_YET = "a later release of slipstream-inference"


def _parse_dtype(value: Any, path: str) -> str:
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str) and value in DTYPE_NAMES:
        return DTYPE_NAMES[value]
    config_fail(path, str(value), "torch.float16/half/fp16, torch.bfloat16/bf16, fp32 or int8")


def _parse_free_mapping(value: Any, path: str) -> dict[Any, Any] | None:
    """A mapping whose keys may be classes (DeepSpeed's ``injection_policy``)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        config_fail(path, value, "an object mapping module classes to layer names, or null")
    return dict(value)


@dataclasses.dataclass(kw_only=True)
class TensorParallelConfig(ConfigBlock):
    """``tensor_parallel``: split each block's linears over ``tp_size`` ranks (AutoTP)."""

    enabled: bool = True
    tp_size: int = dataclasses.field(default=1, metadata={"ge": 1})
    # A model-parallel unit (``get_model_parallel_group()``) or a process group, as in DeepSpeed.
    mpu: Any = None
    tp_group: Any = None
    tp_grain_size: int = dataclasses.field(default=64, metadata={"ge": 1})
    # Slipstream keys: how the blocks' partial sums are added across the ranks ("nccl":
    # torch.distributed.all_reduce; "symm_mem": PyTorch's symmetric-memory one-shot all-reduce
    # over NVLink P2P for messages up to symm_mem_bytes; "symm_mem_or_nccl": symm_mem where it
    # can run, else nccl), see slipstream.inference.allreduce.
    allreduce: Literal["nccl", "symm_mem", "symm_mem_or_nccl"] = "symm_mem_or_nccl"
    symm_mem_bytes: int = dataclasses.field(default=1 << 21, metadata={"ge": 1024})
    # The kernel of the symm_mem sums: "slipstream" (one Triton kernel per sum, pushing over
    # NVLink one way; a block's sum, residual add and RMSNorm in one kernel) or "torch"
    # (torch.ops.symm_mem's one-shot kernel, then add_rms_norm), see
    # slipstream.inference.allreduce_norm.
    symm_mem_kernel: Literal["slipstream", "torch"] = "slipstream"


@dataclasses.dataclass(kw_only=True)
class MoEInferenceConfig(ConfigBlock):
    """``moe``: DeepSpeed's MoE inference settings; experts run on every TP rank (ep_size 1)."""

    enabled: bool = True
    ep_size: int = dataclasses.field(default=1, metadata={"ge": 1})
    moe_experts: list[int] = dataclasses.field(
        default_factory=lambda: [1], metadata={"aliases": ("num_experts",)}
    )
    type: Literal["standard", "residual"] = "standard"
    ep_mp_group: Any = None
    ep_group: Any = dataclasses.field(default=None, metadata={"aliases": ("expert_group",)})

    def validate(self, path: str) -> None:
        if self.ep_size != 1:
            not_implemented(
                key_path(path, "ep_size"),
                self.ep_size,
                "expert parallelism at inference",
                _NOT_YET,
                "Use tensor_parallel.tp_size: the experts' FFNs are split over the TP ranks.",
            )
        if self.type != "standard":
            not_implemented(key_path(path, "type"), self.type, "residual MoE", _NOT_YET)


def _parse_moe(value: Any, path: str) -> MoEInferenceConfig:
    """``moe`` is ``true``/``false`` (DeepSpeed's old form) or the block."""
    if isinstance(value, bool):
        return MoEInferenceConfig(enabled=value)
    return MoEInferenceConfig.from_dict(value, path)


@dataclasses.dataclass(kw_only=True)
class WeightQuantConfig(ConfigBlock):
    """``quant.weight``: weight-only group-wise quantization (used when ``dtype`` is int8)."""

    enabled: bool = True
    num_bits: Literal[8, 4] = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int = dataclasses.field(default=1, metadata={"ge": 1})
    quantized_initialization: dict[str, Any] = dataclasses.field(default_factory=dict)
    post_init_quant: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Slipstream keys: elements per quantization group along a row (-1: one group per row),
    # the compute dtype, and the code format ("int": num_bits-bit integers; "fp8_e4m3": 8-bit
    # floats with the same group-wise scales).
    group_size: int = 128
    compute_dtype: Literal["fp16", "bf16", "fp32"] = "fp16"
    format: Literal["int", "fp8_e4m3"] = "int"
    # Store whole-block weights in the decode GEMV's packed layout (slipstream.kernels'
    # pack_gemv; CUDA-core kernel at <= 8 rows). false: quant_matmul's tile kernel. "auto": on
    # for every format — on an H100 the packed layout decoded an 8B model at 2.18x (int4),
    # 1.60x (int8, f16x2 unpacking) and 1.59x (fp8) bf16's rate against 0.82x / 1.43x / 1.27x
    # with the tile kernel; packed prefill is slower (docs/inference.md).
    gemv_layout: bool | Literal["auto"] = dataclasses.field(
        default="auto", metadata={"allow_auto": True}
    )
    # Quantize the LM head (the vocabulary projection) too, as GPTQ's ``lm_head`` flag does.
    # Off by default (DeepSpeed and most weight-only schemes keep the head in the compute
    # dtype): at batch 1 the bf16 head of a Llama-3-8B is a quarter of an int4 step's bytes,
    # so this is a speed / accuracy trade the user opts into (docs/inference.md).
    lm_head: bool = False
    # The LM head's own bit width when lm_head is true: null (the blocks' num_bits), 8 or 4.
    # int4 blocks with an 8-bit head is llama.cpp's choice of keeping the output projection
    # wider than the body: an 8B Llama's head is 0.53 GB at int8 against 0.27 at int4 and
    # 1.05 in bf16, and on the trained model of tools/bench/head_quant_accuracy.py an int8
    # head cost +0.01% perplexity against +0.55% for an int4 one; on an H100 the 8B int4 step
    # took 2.185 ms with it, 2.338 with the bf16 head, 2.110 with an int4 one (call F,
    # docs/inference.md). The head's groups are the blocks' (group_size, scale_dtype); with
    # format fp8_e4m3 the head is fp8 like the blocks and this key must stay null.
    lm_head_bits: Literal[8, 4] | None = None
    # The dtype the group scales are stored in. "fp16" (GPTQ's and AWQ's): half the scale bytes
    # of fp32 (an int4 weight at group 128 stores 0.516 bytes, not 0.531), each scale rounded up
    # to the next fp16 value and the codes computed from it (no code clips; every weight stays
    # within half a step); a scale above fp16's 65504 (a group's largest |weight| above
    # 65504 * 7 for int4) is an error naming the layer. "bf16": fp32's range, 8 significant
    # bits; "fp32": the scales as computed (docs/inference.md).
    scale_dtype: Literal["fp16", "bf16", "fp32"] = "fp16"
    # Programmatic dependent launch of the fused quantized decode GEMVs (decode_fusion on a
    # packed int8 / int4 / fp8 model; NVIDIA sm_90+, elsewhere plain launches, same results):
    # each may start while the kernel before it finishes, its weights streaming into L2 before
    # it waits for its inputs. true: on, with the L2 prefetch of weights that fit 12 MiB whole
    # (measured on an H200: the 8B int4 step 2.0%, int8 5.2% faster than false);
    # "l2_partial": also the first part of every row of larger weights (gate/up, down);
    # "auto": "l2_partial" for int4 (H100, call S5 of branch q6, one process: the 8B int4 step
    # 2.337 ms against 2.348 with true, now that down runs one K range, which the L2 prefetch
    # covers), true for int8 / fp8; false: plain launches.
    decode_pdl: bool | Literal["auto", "l2_partial"] = dataclasses.field(
        default="auto", metadata={"allow_auto": True}
    )
    # JSON launch table of those fused quantized decode GEMVs (per GPU, format and shape:
    # rows per program, warps, split-K, persistent grid, ...), written by
    # tools/bench/quant_decode_bench.py --table-out; its entries for the running GPU come
    # before the built-in ones (slipstream.kernels.ops.quant_matmul.fused_table). None: the
    # built-in table, then the rule.
    decode_gemv_table: str | None = None

    @property
    def pdl_mode(self) -> str:
        """``decode_pdl`` as the kernels' launch option (``quant_matmul.fused_gemv.PDL_MODES``)."""
        if self.decode_pdl is False:
            return "off"
        if self.decode_pdl == "l2_partial" or (
            self.decode_pdl == "auto" and self.code_format == "int4"
        ):
            return "l2_partial"
        return "on"

    @property
    def packed_gemv(self) -> bool:
        """Whether ``gemv_layout`` packs this format's weights ("auto": int4, int8 and fp8)."""
        if self.gemv_layout == "auto":
            return self.code_format in ("int4", "int8", "fp8_e4m3")
        return bool(self.gemv_layout)

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        """``scale_dtype`` as a torch dtype."""
        return TORCH_DTYPES[self.scale_dtype]

    @property
    def code_format(self) -> str:
        """The ``slipstream.kernels`` quantize format: ``int8``, ``int4`` or ``fp8_e4m3``."""
        return "fp8_e4m3" if self.format == "fp8_e4m3" else f"int{self.num_bits}"

    @property
    def head_format(self) -> str | None:
        """The LM head's quantize format (None: ``lm_head`` off, the head stays dense):
        ``lm_head_bits``' width, else the blocks' :attr:`code_format`."""
        if not self.lm_head:
            return None
        if self.format == "fp8_e4m3" or self.lm_head_bits is None:
            return self.code_format
        return f"int{self.lm_head_bits}"

    def validate(self, path: str) -> None:
        if self.group_size != -1 and self.group_size < 2:
            config_fail(
                key_path(path, "group_size"),
                self.group_size,
                "an integer >= 2 (input features per scale), or -1 for one scale per row",
            )
        if self.format == "fp8_e4m3" and self.num_bits != 8:
            config_fail(
                key_path(path, "num_bits"),
                self.num_bits,
                "8 with format fp8_e4m3 (fp8 codes are 8 bits); use format int for 4-bit",
            )
        if self.lm_head_bits is not None and not self.lm_head:
            raise ConfigError(
                f"{key_path(path, 'lm_head_bits')} = {self.lm_head_bits} needs "
                f"{key_path(path, 'lm_head')} = true (without it the LM head stays in the "
                "compute dtype); set lm_head to true or drop lm_head_bits",
                key_path(path, "lm_head_bits"),
            )
        if self.lm_head_bits is not None and self.format == "fp8_e4m3":
            config_fail(
                key_path(path, "lm_head_bits"),
                self.lm_head_bits,
                "null with format fp8_e4m3 (lm_head: true quantizes the head to fp8 like the "
                "blocks; lm_head_bits sets an integer head's width behind integer blocks, "
                "format int)",
            )
        if self.q_type != "symmetric":
            not_implemented(
                key_path(path, "q_type"), self.q_type, "asymmetric weight quantization", _NOT_YET
            )
        if self.q_groups != 1:
            not_implemented(
                key_path(path, "q_groups"),
                self.q_groups,
                "a fixed group count per matrix",
                _NOT_YET,
                f"Set {key_path(path, 'group_size')} (elements per group) instead.",
            )
        for name in ("quantized_initialization", "post_init_quant"):
            if getattr(self, name):
                not_implemented(
                    key_path(path, name), getattr(self, name), "per-layer quantization", _NOT_YET
                )


@dataclasses.dataclass(kw_only=True)
class _EnabledBlock(ConfigBlock):
    enabled: bool = True
    num_bits: int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int = 1


@dataclasses.dataclass(kw_only=True)
class _QKVQuantConfig(ConfigBlock):
    enabled: bool = True


@dataclasses.dataclass(kw_only=True)
class QuantConfig(ConfigBlock):
    """``quant``: DeepSpeed's quantization block. Only the weight part acts (weight-only)."""

    enabled: bool = True
    activation: _EnabledBlock = dataclasses.field(default_factory=_EnabledBlock)
    weight: WeightQuantConfig = dataclasses.field(default_factory=WeightQuantConfig)
    qkv: _QKVQuantConfig = dataclasses.field(default_factory=_QKVQuantConfig)


@dataclasses.dataclass(kw_only=True)
class OffloadParamConfig(ConfigBlock):
    """``zero.offload_param``: where ZeRO-Inference keeps the weights between uses."""

    device: Literal["none", "cpu", "nvme"] = "none"
    pin_memory: bool = True
    nvme_path: str | None = None
    buffer_count: int = dataclasses.field(default=5, metadata={"ge": 1})
    buffer_size: int = dataclasses.field(default=100_000_000, metadata={"ge": 1})
    max_in_cpu: int = dataclasses.field(default=1_000_000_000, metadata={"ge": 0})

    def validate(self, path: str) -> None:
        if self.device == "nvme" and not self.nvme_path:
            config_fail(
                key_path(path, "nvme_path"),
                self.nvme_path,
                'an existing folder on an NVMe drive when device is "nvme" (the block weights '
                "are kept in swap files there)",
            )


@dataclasses.dataclass(kw_only=True)
class InferenceZeroConfig(ConfigBlock):
    """``zero``: ZeRO-Inference is stage 3 with ``offload_param.device`` = ``cpu``."""

    stage: int = dataclasses.field(default=0, metadata={"ge": 0, "le": 3})
    offload_param: OffloadParamConfig = dataclasses.field(default_factory=OffloadParamConfig)

    def validate(self, path: str) -> None:
        if self.stage in (1, 2):
            config_fail(
                key_path(path, "stage"),
                self.stage,
                "0 or 3 (stages 1 and 2 shard optimizer states and gradients, which inference "
                "does not have)",
            )
        if self.offload_param.device != "none" and self.stage != 3:
            raise ConfigError(
                f"{key_path(path, 'offload_param.device')} = {self.offload_param.device!r} needs "
                f"{key_path(path, 'stage')} = 3 (got {self.stage}), as in DeepSpeed's "
                "ZeRO-Inference",
                key_path(path, "stage"),
            )
        if self.stage == 3 and self.offload_param.device == "none":
            not_implemented(
                key_path(path, "stage"),
                self.stage,
                "ZeRO-3 sharded inference without offload",
                _NOT_YET,
                'Set zero.offload_param.device = "cpu", or use tensor_parallel.tp_size.',
            )


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig(ConfigBlock):
    """``checkpoint_config`` (alias ``ckpt_config``)."""

    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


@dataclasses.dataclass(kw_only=True)
class InferenceConfig(ConfigBlock):
    """Every key of DeepSpeed's inference config; see ``docs/inference.md``.

    >>> InferenceConfig.from_dict({"dtype": "bf16", "tensor_parallel": {"tp_size": 2}}).tp_size
    2
    """

    replace_with_kernel_inject: bool = dataclasses.field(
        default=False, metadata={"aliases": ("kernel_inject",)}
    )
    dtype: str = dataclasses.field(
        default="fp16", metadata={"parser": _parse_dtype, "serializer": str}
    )
    tensor_parallel: TensorParallelConfig = dataclasses.field(
        default_factory=TensorParallelConfig, metadata={"aliases": ("tp",)}
    )
    enable_cuda_graph: bool = False
    use_triton: bool = False  # true: the blocks' dense linears run a Triton GEMV at decode
    # Single-token (batch-1) decode steps of a Llama-like model with dense bf16/fp16 weights run
    # slipstream.kernels' decode GEMVs with add + RMSNorm and SwiGLU fused into them
    # (slipstream.inference.fused_decode). "auto": on CUDA/ROCm devices; true: wherever the
    # model qualifies (a warning says why not); false: the unfused kernels and cuBLAS.
    decode_fusion: bool | Literal["auto"] = dataclasses.field(
        default="auto", metadata={"allow_auto": True}
    )
    # A JSON launch table for the decode GEMVs (tools/bench/bf16_gemv_bench.py --table-out):
    # its entries for this GPU and shape come before the built-in ones
    # (slipstream.kernels.ops.decode_gemv.table). None: the built-in table, then the default rule.
    decode_gemv_table: str | None = None
    # With decode_fusion, the dense (bf16/fp16) single-token step launches its kernels with
    # programmatic dependent launch (NVIDIA sm_90+; elsewhere plain launches): each GEMV loads
    # its first weight tile while the kernel before it finishes, the output projection can
    # prefetch its weight into L2 during attention (slipstream.inference.fused_decode).
    # "auto": fused_decode.AUTO_PDL on one rank; true/false: on/off.
    decode_pdl: bool | Literal["auto"] = dataclasses.field(
        default="auto", metadata={"allow_auto": True}
    )
    triton_autotune: bool = False
    zero: InferenceZeroConfig = dataclasses.field(default_factory=InferenceZeroConfig)
    triangular_masking: bool = dataclasses.field(default=True, metadata={"aliases": ("tm",)})
    moe: MoEInferenceConfig = dataclasses.field(
        default_factory=lambda: MoEInferenceConfig(enabled=False),
        metadata={"parser": _parse_moe, "serializer": lambda block: block.to_dict()},
    )
    quant: QuantConfig = dataclasses.field(default_factory=QuantConfig)
    checkpoint: str | dict[str, Any] | None = None
    base_dir: str = ""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: CheckpointConfig = dataclasses.field(
        default_factory=CheckpointConfig, metadata={"aliases": ("ckpt_config",)}
    )
    return_tuple: bool = True
    training_mp_size: int = dataclasses.field(default=1, metadata={"ge": 1})
    replace_method: str = "auto"
    injection_policy: Any = dataclasses.field(
        default=None, metadata={"aliases": ("injection_dict",), "parser": _parse_free_mapping}
    )
    injection_policy_tuple: Any = None
    config: dict[str, Any] | None = dataclasses.field(default=None, metadata={"aliases": ("args",)})
    max_out_tokens: int = dataclasses.field(
        default=1024, metadata={"aliases": ("max_tokens",), "ge": 1}
    )
    min_out_tokens: int = dataclasses.field(
        default=1, metadata={"aliases": ("min_tokens",), "ge": 1}
    )
    transposed_mode: bool = False
    # Deprecated DeepSpeed spellings, folded into their new places by validate().
    mp_size: int = dataclasses.field(default=1, metadata={"ge": 1})
    mpu: Any = None
    ep_size: int = dataclasses.field(default=1, metadata={"ge": 1})
    ep_group: Any = dataclasses.field(default=None, metadata={"aliases": ("expert_group",)})
    ep_mp_group: Any = dataclasses.field(default=None, metadata={"aliases": ("expert_mp_group",)})
    moe_experts: list[int] = dataclasses.field(default_factory=lambda: [1])
    moe_type: Literal["standard", "residual"] = "standard"
    tp_grain_size: int = dataclasses.field(default=64, metadata={"ge": 1})

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree (``tensor_parallel.tp_size``, or the old ``mp_size``)."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the model computes in (for int8 weights: ``quant.weight.compute_dtype``)."""
        if self.dtype == "int8":
            return TORCH_DTYPES[self.quant.weight.compute_dtype]
        return TORCH_DTYPES[self.dtype]

    @property
    def weight_bits(self) -> int | None:
        """Bits of the weight-only quantization (None when weights stay in ``dtype``)."""
        if self.dtype != "int8" or not (self.quant.enabled and self.quant.weight.enabled):
            return None
        return self.quant.weight.num_bits

    @property
    def checkpoint_path(self) -> str | None:
        """The Hugging Face checkpoint to load (``checkpoint`` or ``checkpoint_config``)."""
        path = self.checkpoint if isinstance(self.checkpoint, str) else None
        path = path or self.checkpoint_config.checkpoint_dir
        base = self.base_dir or self.checkpoint_config.base_dir or ""
        return os.path.join(base, path) if path and base else path

    def validate(self, path: str) -> None:
        if self.mp_size != 1:
            if self.tensor_parallel.tp_size not in (1, self.mp_size):
                raise ConfigError(
                    f"{key_path(path, 'mp_size')} = {self.mp_size} (deprecated) disagrees with "
                    f"{key_path(path, 'tensor_parallel.tp_size')} = "
                    f"{self.tensor_parallel.tp_size}; keep only tensor_parallel.tp_size",
                    key_path(path, "mp_size"),
                )
            self.tensor_parallel.tp_size = self.mp_size
        if self.mpu is not None and self.tensor_parallel.mpu is None:
            self.tensor_parallel.mpu = self.mpu
        if self.max_out_tokens < self.min_out_tokens:
            raise ConfigError(
                f"{key_path(path, 'max_out_tokens')} = {self.max_out_tokens} is below "
                f"{key_path(path, 'min_out_tokens')} = {self.min_out_tokens}; raise max_out_tokens",
                key_path(path, "max_out_tokens"),
            )
        if self.replace_method != "auto":
            config_fail(key_path(path, "replace_method"), self.replace_method, '"auto"')
        refused = {
            "triton_autotune": (self.triton_autotune, "Triton autotuning at init"),
            "triangular_masking": (not self.triangular_masking, "non-causal attention masks"),
            "set_empty_params": (self.set_empty_params, "empty-parameter injection"),
            "save_mp_checkpoint_path": (
                self.save_mp_checkpoint_path or self.checkpoint_config.save_mp_checkpoint_path,
                "saving a resharded checkpoint",
            ),
            "training_mp_size": (self.training_mp_size != 1, "loading Megatron TP checkpoints"),
            "injection_policy_tuple": (self.injection_policy_tuple, "tuple injection policies"),
            "config": (self.config, "a model config given apart from the model"),
            "transposed_mode": (self.transposed_mode, "transposed weights"),
            "ep_size": (self.ep_size != 1, "expert parallelism at inference"),
            "moe_type": (self.moe_type != "standard", "residual MoE"),
            "checkpoint": (
                isinstance(self.checkpoint, dict),
                "DeepSpeed's JSON load policies (checkpoint as an object)",
            ),
        }
        if self.enable_cuda_graph and self.zero.offload_param.device != "none":
            not_implemented(
                key_path(path, "enable_cuda_graph"),
                True,
                "CUDA graphs over weights streamed by ZeRO-Inference (their addresses change)",
                _NOT_YET,
                "Set enable_cuda_graph to false with zero.offload_param.",
            )
        for name, (asked, feature) in refused.items():
            if asked:
                not_implemented(key_path(path, name), getattr(self, name), feature, _NOT_YET)


def load_inference_config(
    config: str | os.PathLike[str] | Mapping[str, Any] | InferenceConfig | None,
    **kwargs: Any,
) -> InferenceConfig:
    """Parse ``config`` (dict, JSON path or parsed block) merged with keyword arguments.

    Keywords follow DeepSpeed: a key given both in ``config`` and as a keyword must agree.
    """
    if isinstance(config, InferenceConfig):
        if not kwargs:
            return config
        config = config.to_dict()
    if isinstance(config, (str, os.PathLike)):
        text = Path(config).read_text()
        try:
            data: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"inference config file {config}: not valid JSON ({error})") from None
    elif config is None:
        data = {}
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise ConfigError(
            f"init_inference: config must be a dict, a JSON file path or None, got "
            f"{type(config).__name__}"
        )
    for key, value in kwargs.items():
        if key in data and data[key] != value:
            raise ConfigError(
                f"'{key}' is given both in the config ({data[key]!r}) and as a keyword "
                f"({value!r}); give it once",
                key,
            )
        data[key] = value
    return InferenceConfig.from_dict(data)
