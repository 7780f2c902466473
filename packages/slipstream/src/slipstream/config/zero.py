"""The ``zero_optimization`` block: every DeepSpeed ZeRO key, typed; stages 0-3 implemented."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import Any, Literal

from slipstream.kernels.config_schema import (
    ConfigBlock,
    ConfigError,
    field_default,
    key_path,
    not_implemented,
)

__all__ = ["AioConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig"]

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
    """``zero_optimization.offload_optimizer``: optimizer state offload to CPU or NVMe.

    DeepSpeed's keys and defaults, plus Slipstream additions (docs/config.md, "Deviations";
    docs/offload.md): ``overlap_forward`` (off by default): ``engine.step()`` returns while the
    CPU still steps the last gradient buckets, and the next forward waits for each layer's;
    ``overlap_step`` and ``speculative_step`` (on): at stages 1-2 on the CPU, step each bucket
    during backward (exactly without clipping or fp16 loss scaling; speculatively with
    either); ``overlap_bucket_size`` (1e8): the reduce buckets' cap while stepping during
    backward; ``early_upload`` (on): with ``overlap_forward`` on a GPU, upload each deferred
    bucket as its CPU step ends; ``threads`` (0: chosen from the cores and
    ``cpuadam_cores_perc``) and ``cpu_schedule`` (``"static"`` or ``"dynamic"``) of the
    CPU step; ``gpu_share`` (0.0): the share of each step's elements that the GPU steps
    instead of the CPU (states streamed from and back to host memory); ``merge_bucket_size``
    (0): landed buckets stepped in one C++ call, up to this many elements;
    ``upload_model_dtype`` (off): upload a model-dtype copy the CPU step writes, not the fp32.
    """

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
    # A Slipstream addition (docs/offload.md): engine.step() returns while the CPU still steps
    # the last buckets, which the next forward waits for layer by layer.
    overlap_forward: bool = False
    # Slipstream additions: what the CPU step does during backward and how it runs.
    overlap_step: bool = True
    speculative_step: bool = True
    overlap_bucket_size: int = dataclasses.field(default=100_000_000, metadata={"ge": 1})
    early_upload: bool = True
    threads: int = _ge0(0)
    cpu_schedule: Literal["static", "dynamic"] = "dynamic"
    # Slipstream additions (docs/offload.md, "How the CPU step moves memory"): the C++ Adam's
    # stores and prefetch; the same values either way.
    cpu_stores: Literal["stream_out", "mixed", "stream"] = "stream_out"
    cpu_prefetch: int = _ge0(0)
    # A Slipstream addition (docs/offload.md, "gpu_share"): the share of each CPU step's
    # elements stepped on the GPU instead, their states streamed from and back to host memory.
    gpu_share: float = dataclasses.field(default=0.0, metadata={"ge": 0.0, "le": 1.0})
    # A Slipstream addition (docs/offload.md, "The worker and the GIL"): Python's switch
    # interval while the CPU step's worker runs, in microseconds (0: Python's own).
    gil_switch_interval_us: float = dataclasses.field(default=0.0, metadata={"ge": 0.0})
    # A Slipstream addition (docs/offload.md, "Merged bucket steps"): landed buckets the CPU
    # worker would step next share one C++ call, up to this many elements (0: one per bucket).
    merge_bucket_size: int = _ge0(0)
    # A Slipstream addition (docs/offload.md, "What the all-gather uploads"): the CPU step
    # writes a model-dtype copy of each updated master, which is uploaded instead of the fp32.
    upload_model_dtype: bool = False


@dataclasses.dataclass(kw_only=True)
class AioConfig(ConfigBlock):
    """``aio``: the asynchronous I/O engine of NVMe offload (slipstream.offload.aio).

    DeepSpeed's keys and defaults, plus ``o_direct`` (a Slipstream addition: open swap files
    with ``O_DIRECT``, bypassing the page cache; set false only for file systems that reject
    it, such as tmpfs), ``verify_checksums`` (check every swap payload read against the
    checksum recorded at its write; default true) and ``kernel_aio`` (a Slipstream addition:
    with O_DIRECT, issue Linux kernel AIO; false keeps the C++ engine on its pread/pwrite thread
    pool). ``use_gds`` (GPUDirect Storage) is not supported.
    """

    block_size: int = dataclasses.field(default=1048576, metadata={"ge": 1})
    queue_depth: int = dataclasses.field(default=8, metadata={"ge": 1})
    intra_op_parallelism: int = dataclasses.field(
        default=1, metadata={"ge": 1, "aliases": ("thread_count",)}
    )
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False
    o_direct: bool = True
    verify_checksums: bool = True
    kernel_aio: bool = True

    def validate(self, path: str) -> None:
        """GPUDirect Storage is not implemented; O_DIRECT needs 4 KiB-aligned blocks."""
        if self.use_gds:
            not_implemented(
                key_path(path, "use_gds"),
                True,
                "GPUDirect Storage (NVMe straight to GPU memory)",
                "a later release of the slipstream-offload-io package",
                "Remove it or set it to false (swaps go through pinned host buffers).",
            )
        if self.o_direct and self.block_size % 4096:
            raise ConfigError(
                f"{key_path(path, 'block_size')}={self.block_size}: with O_DIRECT the block "
                "size must be a multiple of 4096 bytes (e.g. 1048576)",
                key_path(path, "block_size"),
            )


# Keys that change what Slipstream's stage-0 data parallelism does; every other ZeRO key only
# configures stages 1-3 (the engine's gradient all-reduce uses reduce_bucket_size as its
# bucket size).
STAGE0_EFFECTIVE_KEYS = frozenset({"stage", "reduce_bucket_size"})


# ZeRO++ / MiCS switches not built yet: (field, inert value, what it asks for).
_ZERO_PLUS_PLUS: tuple[tuple[str, Any, str], ...] = (
    ("zero_quantized_nontrainable_weights", False, "ZeRO++ quantized frozen weights"),
)
# ZeRO++ / MiCS switches that run (stage 3 only; slipstream.zero.zeropp): field, inert value.
_ZERO_PLUS_PLUS_STAGE3: tuple[tuple[str, Any], ...] = (
    ("zero_quantized_weights", False),
    ("zero_quantized_gradients", False),
    ("mics_shard_size", -1),
    ("zero_hpz_partition_size", 1),
    ("mics_hierarchical_params_gather", False),
)


@dataclasses.dataclass(kw_only=True)
class ZeroConfig(ConfigBlock):
    """ZeRO settings (``"zero_optimization": {...}``), with DeepSpeed's keys and defaults.

    Stages 0 (plain data parallelism) to 3 run (stages 1-3 through the slipstream-zero
    package; docs/zero.md says which key does what), with optimizer offload to CPU or NVMe and
    parameter offload to CPU (slipstream-offload-io; docs/offload.md). At stage 3, ZeRO++'s
    quantized weight all-gather and gradient reduce-scatter, hpZ and MiCS shard groups run
    (slipstream.zero.zeropp), MiCS's hierarchical gather too. Parameter offload to NVMe,
    quantized frozen weights and ZenFlow are recognised and rejected with a clear error; every
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
    # Slipstream's own: stage 3 caps each reduce-scatter bucket at 1/parts of the model's
    # trainable elements (never below its largest parameter); 0: reduce_bucket_size alone.
    stage3_reduce_bucket_parts: int = _ge0(64)
    # Slipstream's own: stages 1-2 launch the all-gathers of updated shards asynchronously
    # after the step and land each bucket as the next forward reaches its parameters.
    publish_during_forward: bool = False
    # Slipstream's own: stages 1-2 split the last reduce-scatter bucket of a backward into
    # buckets of at most this many elements (0: no split; unset: 5e7, none with optimizer
    # offload).
    reduce_bucket_tail_size: int | None = _ge0(None)
    # Slipstream's own: stages 1-2 publish updated shards by all-gathers ("collective") or by
    # peer copies out of a symmetric-memory parameter buffer ("copy_engine", one NVLink node);
    # "auto": the copy engines where they work, the all-gathers elsewhere.
    publish_transport: Literal["auto", "collective", "copy_engine"] = dataclasses.field(
        default="auto", metadata={"allow_auto": True}
    )
    # Slipstream's own: stages 1-2 run the gradient reduce-scatters on a communicator of their
    # own limited to this many CTAs (NCCL's maxCTAs); 0: NCCL's choice.
    reduce_scatter_max_ctas: int = _ge0(0)
    # Slipstream's own: stages 1-2 average inside the NCCL reduce-scatter (ReduceOp.AVG) where
    # that is exact (a power-of-two group), instead of a pass over each bucket after it.
    average_in_reduce_scatter: bool = True
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
    # Slipstream's own: qgZ's code width, 8 (int8) or 4 (int4, two per byte, as DeepSpeed's).
    zero_quantized_gradients_bits: Literal[4, 8] = 8
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
        """Raise NotImplementedFeatureError for ZeRO++, MiCS, ZenFlow and unsupported offload."""
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
        for name, inert in _ZERO_PLUS_PLUS_STAGE3:
            value = getattr(self, name)
            if value != inert and self.stage in (1, 2):
                raise ConfigError(
                    f"{key_path(path, name)}={value!r} needs zero_optimization.stage 3 (ZeRO++ "
                    f"and MiCS change how stage 3 gathers parameters), but stage is "
                    f"{self.stage}; set stage to 3 or remove {name}",
                    key_path(path, name),
                )
        if self.mics_shard_size == 0 or self.mics_shard_size < -1:
            raise ConfigError(
                f"{key_path(path, 'mics_shard_size')}={self.mics_shard_size}: expected -1 (off) "
                "or a positive number of ranks per shard group that divides the world size",
                key_path(path, "mics_shard_size"),
            )
        self.leaf_modules(path)
        if self.zenflow is not None:
            not_implemented(
                key_path(path, "zenflow"), self.zenflow, "ZenFlow", _ZERO, "Remove the block."
            )
        self._validate_offload(path)

    def leaf_modules(self, path: str = "zero_optimization") -> dict[str, tuple[str, ...]]:
        """``leaf_module`` as ``{"classes": (...), "names": (...), "name_suffixes": (...)}``
        (DeepSpeed's keys; each a list of strings); raises ConfigError naming the key path."""
        where = key_path(path, "leaf_module")
        keys = ("classes", "names", "name_suffixes")
        found: dict[str, tuple[str, ...]] = {key: () for key in keys}
        for key, value in self.leaf_module.items():
            if key not in keys:
                raise ConfigError(
                    f"{where}.{key}: unknown key; expected {', '.join(keys)} (lists of module "
                    "class names, module names, or module name suffixes)",
                    f"{where}.{key}",
                )
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigError(
                    f"{where}.{key} = {value!r} is not valid: expected a list of strings",
                    f"{where}.{key}",
                )
            found[key] = tuple(value)
        return found

    def optimizer_offload(self) -> OffloadOptimizerConfig | None:
        """The effective optimizer offload block (None: off), the deprecated switch included."""
        block = self.offload_optimizer
        if block is not None and block.device != "none":
            return block
        if self.cpu_offload:
            return OffloadOptimizerConfig(
                device="cpu", pin_memory=bool(self.cpu_offload_use_pin_memory)
            )
        return None

    def param_offload(self) -> OffloadParamConfig | None:
        """The effective parameter offload block (None: off), the deprecated switch included."""
        block = self.offload_param
        if block is not None and block.device != "none":
            return block
        if self.cpu_offload_param:
            return OffloadParamConfig(
                device="cpu", pin_memory=bool(self.cpu_offload_use_pin_memory)
            )
        return None

    def _validate_offload(self, path: str) -> None:
        if self.stage == 0:
            return  # inert at stage 0, as in DeepSpeed; from_dict warns that they do nothing
        optimizer, param = self.optimizer_offload(), self.param_offload()
        where = key_path(path, "offload_optimizer")
        if optimizer is not None:
            if optimizer.device == "nvme" and not optimizer.nvme_path:
                raise ConfigError(
                    f'{where}.device="nvme" needs "nvme_path": a folder on a local NVMe drive '
                    "for the swap files",
                    key_path(where, "nvme_path"),
                )
            if optimizer.ratio != 1.0 and optimizer.device == "nvme":
                not_implemented(
                    key_path(where, "ratio"),
                    optimizer.ratio,
                    "partial optimizer offload to NVMe (ratio below 1 with device nvme)",
                    "a later release of the slipstream-offload-io package",
                    'Set it to 1.0, or use device "cpu" for partial offload.',
                )
            if optimizer.overlap_forward and (self.stage == 3 or optimizer.device != "cpu"):
                raise ConfigError(
                    f'{where}.overlap_forward needs ZeRO stage 1 or 2 with device "cpu" (the '
                    "optimizer must step during backward for its end to overlap the next "
                    f"forward); here stage is {self.stage} and device {optimizer.device!r}. "
                    "Remove it or set it to false.",
                    key_path(where, "overlap_forward"),
                )
            if optimizer.gpu_share > 0 and (self.stage == 3 or optimizer.device != "cpu"):
                raise ConfigError(
                    f"{where}.gpu_share={optimizer.gpu_share} needs ZeRO stage 1 or 2 with "
                    f'device "cpu" (it splits the CPU step of the offloaded gradient buckets); '
                    f"here stage is {self.stage} and device {optimizer.device!r}. Remove it or "
                    "set it to 0.",
                    key_path(where, "gpu_share"),
                )
            if optimizer.super_offload:
                not_implemented(
                    key_path(where, "super_offload"),
                    True,
                    "SuperOffload (speculative CPU steps for superchips)",
                    "a later release of the slipstream-offload-io package",
                    "Remove it or set it to false.",
                )
        where = key_path(path, "offload_param")
        if param is not None:
            if self.stage != 3:
                raise ConfigError(
                    f"{where}.device={param.device!r} needs ZeRO stage 3 (only stage 3 "
                    f"partitions parameters); stage is {self.stage}. Use offload_optimizer at "
                    "stages 1-2, or set stage 3.",
                    key_path(where, "device"),
                )
            if param.device == "nvme" and not param.nvme_path:
                raise ConfigError(
                    f'{where}.device="nvme" needs "nvme_path": a folder on a local NVMe drive '
                    "for the swap files",
                    key_path(where, "nvme_path"),
                )
