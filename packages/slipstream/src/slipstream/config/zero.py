"""The ``zero_optimization`` block: every DeepSpeed ZeRO key, typed; stages 0-3 implemented."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import Any, Literal

from slipstream.kernels.config_schema import (
    ConfigBlock,
    field_default,
    key_path,
    not_implemented,
)

__all__ = ["OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig"]

logger = logging.getLogger(__name__)

_ZERO = "the slipstream-zero package"
OffloadDevice = Literal["none", "cpu", "nvme"]


def _ge0(default: Any, *aliases: str) -> Any:
    """A non-negative integer field (DeepSpeed's ``Field(..., ge=0)``), with optional aliases."""
    return dataclasses.field(default=default, metadata={"ge": 0, "aliases": aliases})


def _alias(default: Any, *aliases: str) -> Any:
    return dataclasses.field(default=default, metadata={"aliases": aliases})


@dataclasses.dataclass(kw_only=True)
class OffloadParamConfig(ConfigBlock):
    """``zero_optimization.offload_param``: parameter offload to CPU or NVMe (ZeRO-3 only)."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: int = _ge0(5)
    buffer_size: int = _ge0(100_000_000)
    max_in_cpu: int = _ge0(1_000_000_000)
    pin_memory: bool = False


@dataclasses.dataclass(kw_only=True)
class OffloadOptimizerConfig(ConfigBlock):
    """``zero_optimization.offload_optimizer``: optimizer state offload to CPU or NVMe."""

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    buffer_count: int = _ge0(4)
    pin_memory: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = dataclasses.field(default=1.0, metadata={"ge": 0.0, "le": 1.0})
    super_offload: bool = False
    convert_grad_on_cpu: bool = True
    cpuadam_cores_perc: float = dataclasses.field(default=0.8, metadata={"ge": 0.0, "le": 1.0})


# Keys that change what Slipstream's stage-0 data parallelism does; every other ZeRO key only
# configures stages 1-3 (the engine's gradient all-reduce uses reduce_bucket_size as its
# bucket size).
STAGE0_EFFECTIVE_KEYS = frozenset({"stage", "reduce_bucket_size"})


# ZeRO++ / MiCS switches: (field, inert value, what it asks for).
_ZERO_PLUS_PLUS: tuple[tuple[str, Any, str], ...] = (
    ("zero_quantized_weights", False, "ZeRO++ quantized weight all-gather (qwZ)"),
    ("zero_quantized_nontrainable_weights", False, "ZeRO++ quantized frozen weights"),
    ("zero_quantized_gradients", False, "ZeRO++ quantized gradient reduction (qgZ)"),
    ("zero_hpz_partition_size", 1, "ZeRO++ hierarchical partitioning (hpZ)"),
    ("mics_shard_size", -1, "MiCS sharding within sub-groups"),
)


@dataclasses.dataclass(kw_only=True)
class ZeroConfig(ConfigBlock):
    """ZeRO settings (``"zero_optimization": {...}``), with DeepSpeed's keys and defaults.

    Stages 0 (plain data parallelism) to 3 run (stages 1-3 through the slipstream-zero
    package; docs/zero.md says which key does what). Offload, ZeRO++ (quantized weights and
    gradients, hpZ), MiCS and ZenFlow are recognised and rejected with a clear error; every
    key is typed and checked so a config keeps working unchanged when they arrive. The ``stage3_*`` keys
    also accept DeepSpeed's Python names without the prefix (``prefetch_bucket_size``).
    ``overlap_comm`` left unset means DeepSpeed's default: on at stage 3, off otherwise.
    """

    stage: Literal[0, 1, 2, 3] = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = _ge0(500_000_000)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = _ge0(500_000_000)
    overlap_comm: bool | None = None
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    # ZenFlow's own schema gives "auto" a meaning, so it is kept free-form until slipstream-zero.
    zenflow: dict[str, Any] | None = dataclasses.field(default=None, metadata={"allow_auto": True})
    sub_group_size: int = _ge0(1_000_000_000)
    cpu_offload_param: bool | None = None
    cpu_offload_use_pin_memory: bool | None = None
    cpu_offload: bool | None = None
    stage3_prefetch_bucket_size: int = _ge0(50_000_000, "prefetch_bucket_size")
    stage3_param_persistence_threshold: int = _ge0(100_000, "param_persistence_threshold")
    stage3_model_persistence_threshold: int = _ge0(sys.maxsize, "model_persistence_threshold")
    stage3_max_live_parameters: int = _ge0(1_000_000_000, "max_live_parameters")
    stage3_max_reuse_distance: int = _ge0(1_000_000_000, "max_reuse_distance")
    stage3_gather_16bit_weights_on_model_save: bool = _alias(
        False, "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"
    )
    stage3_module_granularity_threshold: int = _alias(0, "module_granularity_threshold")
    stage3_use_all_reduce_for_fetch_params: bool = _alias(False, "use_all_reduce_for_fetch_params")
    stage3_allgather_sequential: bool = _alias(False, "allgather_sequential")
    stage3_partition_stream_chunk_size: int = _ge0(0, "partition_stream_chunk_size")
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    zero_hpz_partition_size: int = _ge0(1)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: dict[str, Any] | None = None
    mics_shard_size: int = -1
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    leaf_module: dict[str, Any] = dataclasses.field(default_factory=dict)
    compute_grad_norm: bool = True
    parameter_alignment: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, path: str = "") -> ZeroConfig:
        """Parse and validate; at stage 0, warn once about keys that only configure ZeRO 1-3."""
        config = super().from_dict(data, path)
        if data and config.stage == 0:
            inert = config._stage0_inert_keys(data)
            if inert:
                where = path or "zero_optimization"
                logger.warning(
                    "%s: these keys only configure ZeRO stages 1-3 and have no effect at "
                    "stage 0: %s",
                    where,
                    ", ".join(inert),
                )
        return config

    def _stage0_inert_keys(self, data: Mapping[str, Any]) -> list[str]:
        """Keys (as written) set to a non-default value that stage 0 does not read."""
        fields = {item.name: item for item in dataclasses.fields(self)}
        alias_of = {
            alias: item.name
            for item in fields.values()
            for alias in item.metadata.get("aliases", ())
        }
        inert = []
        for key in data:
            name = alias_of.get(key, key)
            if name in STAGE0_EFFECTIVE_KEYS:
                continue
            value = getattr(self, name)
            if (
                isinstance(value, (OffloadParamConfig, OffloadOptimizerConfig))
                and value.device == "none"
            ):
                continue  # an explicit "no offload" block
            if value is False and name.startswith("cpu_offload"):
                continue  # the deprecated switches, explicitly off
            if value != field_default(fields[name]):
                inert.append(key)
        return inert

    def validate(self, path: str) -> None:
        """Raise NotImplementedFeatureError for offload, ZeRO++, MiCS and ZenFlow."""
        for name, inert, feature in _ZERO_PLUS_PLUS:
            value = getattr(self, name)
            if value != inert and value is not None:
                not_implemented(
                    key_path(path, name),
                    value,
                    feature,
                    "a later release of " + _ZERO,
                    f"Remove it or set it to {inert!r}.",
                )
        if self.zenflow is not None:
            not_implemented(
                key_path(path, "zenflow"), self.zenflow, "ZenFlow", _ZERO, "Remove the block."
            )
        for name, block in (
            ("offload_optimizer", self.offload_optimizer),
            ("offload_param", self.offload_param),
        ):
            if block is not None and block.device != "none":
                not_implemented(
                    key_path(key_path(path, name), "device"),
                    block.device,
                    f"{name.replace('_', ' ')} (ZeRO-Offload / ZeRO-Infinity)",
                    f"{_ZERO} (with slipstream-offload-io for NVMe)",
                    'Set "device": "none" or remove the block.',
                )
        for name in ("cpu_offload", "cpu_offload_param"):
            if getattr(self, name):
                not_implemented(
                    key_path(path, name),
                    True,
                    "ZeRO-Offload (the deprecated switch for offload_optimizer/offload_param)",
                    _ZERO,
                    "Remove it or set it to false.",
                )
