"""SlipstreamConfig, the whole DeepSpeed-style config, and ``load_config`` that builds it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from slipstream.comm.config import CommsLoggerConfig, TensorParallelConfig
from slipstream.compression.config import CompressionConfig
from slipstream.config.batch import resolve_batch_sizes
from slipstream.config.blocks import AmdSpecificConfig, OptimizerConfig, SchedulerConfig
from slipstream.config.checkpoint import CheckpointConfig
from slipstream.config.features import RECOGNISED_FEATURES, check_recognised_features
from slipstream.config.loading import ConfigSource, read_config_source
from slipstream.config.monitor import (
    CometConfig,
    CsvMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from slipstream.config.precision import (
    BF16Config,
    FP16Config,
    communication_dtype_name,
    parse_communication_dtype,
)
from slipstream.config.zero import AioConfig, ZeroConfig
from slipstream.data.config import CurriculumLearningConfig, DataEfficiencyConfig
from slipstream.data.progressive_layer_drop import ProgressiveLayerDropConfig
from slipstream.kernels.config_schema import (
    ConfigBlock,
    ConfigError,
    config_fail,
    unknown_keys_error,
)
from slipstream.pipeline.checkpointing import ActivationCheckpointingConfig
from slipstream.pipeline.config import PipelineConfig

__all__ = ["SlipstreamConfig", "load_config"]

logger = logging.getLogger(__name__)


def _positive(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"gt": 0})


@dataclasses.dataclass(kw_only=True)
class SlipstreamConfig(ConfigBlock):
    """A whole training config: DeepSpeed's JSON schema, typed and validated.

    Build it with :func:`load_config`, which also resolves the batch triple for the
    data-parallel world size; after that the three batch fields are ints. ``raw`` is the
    user's config as given (a copy), ``features`` the recognised-but-unimplemented keys that
    were present with inert values. See docs/config.md for every key.

    >>> config = load_config({"train_batch_size": 16, "fp16": {"enabled": True}}, world_size=2)
    >>> config.train_micro_batch_size_per_gpu, config.fp16.initial_scale_power
    (8, 16)
    """

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = dataclasses.field(default=0.0, metadata={"ge": 0})
    # Slipstream's own key (DeepSpeed has none for fp32): bf16 runs read bf16.check_grad_overflow
    # and fp16 runs always skip through the loss scaler. See docs/reliability.md.
    check_grad_overflow: bool = True
    steps_per_print: int = dataclasses.field(default=10, metadata={"ge": 1})
    wall_clock_breakdown: bool = False
    dump_state: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = _positive(1.0)
    communication_data_type: torch.dtype | None = dataclasses.field(
        default=None,
        metadata={"parser": parse_communication_dtype, "serializer": communication_dtype_name},
    )
    fp16: FP16Config = dataclasses.field(default_factory=FP16Config)
    bf16: BF16Config = dataclasses.field(
        default_factory=BF16Config, metadata={"aliases": ("bfloat16",)}
    )
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    # DeepSpeed reads this flag for truth, so configs in the wild write 1 for true.
    zero_allow_untested_optimizer: bool = dataclasses.field(
        default=False, metadata={"parser": lambda value, path: lenient_bool(value, path)}
    )
    zero_force_ds_cpu_optimizer: bool = True
    amd_specific: AmdSpecificConfig = dataclasses.field(default_factory=AmdSpecificConfig)
    comms_logger: CommsLoggerConfig = dataclasses.field(default_factory=CommsLoggerConfig)
    # Owned by slipstream-comm: `initialize` applies AutoTP and builds the DP x TP grid from it.
    tensor_parallel: TensorParallelConfig = dataclasses.field(default_factory=TensorParallelConfig)
    # Owned by slipstream-pipeline: the PipelineEngine reads `pipeline`; `initialize` hands
    # `activation_checkpointing` to slipstream.checkpointing.configure() for every model.
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointingConfig = dataclasses.field(
        default_factory=ActivationCheckpointingConfig
    )
    dataloader_drop_last: bool = False
    # Ulysses sequence parallelism (slipstream.comm.sequence): initialize() builds the SP
    # groups; the data loader shards over world / SP replicas (docs/sequence-parallel.md).
    sequence_parallel_size: int = dataclasses.field(default=1, metadata={"ge": 1})
    # Owned by slipstream-data-efficiency: the engine's DataEfficiency runtime reads both.
    curriculum_learning: CurriculumLearningConfig = dataclasses.field(
        default_factory=CurriculumLearningConfig
    )
    data_efficiency: DataEfficiencyConfig = dataclasses.field(default_factory=DataEfficiencyConfig)
    # Owned by slipstream-compression: the engine steps its CompressionScheduler.
    compression_training: CompressionConfig = dataclasses.field(default_factory=CompressionConfig)
    # Owned by slipstream-data-efficiency: the engine passes pld_theta to the model's forward.
    progressive_layer_drop: ProgressiveLayerDropConfig = dataclasses.field(
        default_factory=ProgressiveLayerDropConfig
    )
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    # The monitors (slipstream.monitor): rank 0 writes the engine's events to each enabled one.
    tensorboard: TensorBoardConfig = dataclasses.field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    csv_monitor: CsvMonitorConfig = dataclasses.field(default_factory=CsvMonitorConfig)
    comet: CometConfig = dataclasses.field(default_factory=CometConfig)

    raw: dict[str, Any] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    features: dict[str, Any] = dataclasses.field(default_factory=dict, init=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, path: str = "") -> SlipstreamConfig:
        """Parse and validate a config dict; batch sizes stay as given (see load_config)."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            config_fail(path, data, "a JSON object (the top level of a DeepSpeed config)")
        data = _normalise_legacy_zero(data)
        typed = {key: value for key, value in data.items() if key not in RECOGNISED_FEATURES}
        recognised = {key: value for key, value in data.items() if key in RECOGNISED_FEATURES}
        valid = cls.config_keys()
        unknown = [str(key) for key in typed if key not in valid]
        if unknown:
            raise unknown_keys_error(path, unknown, [*valid, *RECOGNISED_FEATURES])
        config = super().from_dict(typed, path)
        config.features = check_recognised_features(recognised, path)
        config.raw = dict(data)
        return config

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value (inert recognised blocks included); load_config reads it back."""
        out = super().to_dict()
        out.update(self.features)
        return out

    def validate(self, path: str) -> None:
        """Cross-block checks: fp16 and bf16 cannot both be on."""
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled and bf16.enabled are both true; enable one mixed-precision mode "
                "(bf16 needs no loss scaling and is the usual choice where the hardware has it)",
                "fp16.enabled",
            )


def lenient_bool(value: Any, path: str) -> bool:
    """A boolean that also takes 0 and 1, where DeepSpeed only tests the value for truth."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    config_fail(path, value, "true or false (or 0/1)")


def _normalise_legacy_zero(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """DeepSpeed's oldest form, ``"zero_optimization": true/false``, as a stage number."""
    legacy = data.get("zero_optimization")
    if not isinstance(legacy, bool):
        return data
    logger.warning(
        'the boolean form "zero_optimization": %s is deprecated (as in DeepSpeed); '
        'write "zero_optimization": {"stage": %d} instead',
        str(legacy).lower(),
        int(legacy),
    )
    block: dict[str, Any] = {"stage": 1 if legacy else 0}
    if legacy and "allgather_size" in data:
        block["allgather_bucket_size"] = data["allgather_size"]
    return {**data, "zero_optimization": block}


def load_config(source: ConfigSource, world_size: int) -> SlipstreamConfig:
    """Read, validate and complete a DeepSpeed-style config for ``world_size`` data-parallel ranks.

    ``source`` is a dict, a path to a JSON file, JSON text, or base64-encoded JSON; JSON may
    hold ``//`` and ``/* */`` comments and trailing commas. Missing keys take DeepSpeed's
    defaults; the batch triple is completed (train = micro × GAS × ``world_size``).

    Raises:
        ConfigError: a missing file, invalid JSON (with line and column), an unknown key
            (with the closest valid one), a wrong type or value, ``"auto"`` placeholders
            (:class:`~slipstream.kernels.config_schema.AutoValueError`) or inconsistent
            batch sizes (with the arithmetic).
        NotImplementedFeatureError: a recognised DeepSpeed feature this release lacks.

    >>> config = load_config('{"train_micro_batch_size_per_gpu": 4, // per rank\\n'
    ...                      ' "gradient_accumulation_steps": 2}', world_size=4)
    >>> config.train_batch_size
    32
    """
    raw, origin = read_config_source(source)
    config = SlipstreamConfig.from_dict(raw)
    sizes = resolve_batch_sizes(
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        world_size,
    )
    config.train_batch_size = sizes.train_batch_size
    config.train_micro_batch_size_per_gpu = sizes.train_micro_batch_size_per_gpu
    config.gradient_accumulation_steps = sizes.gradient_accumulation_steps
    config.raw = raw
    logger.debug("loaded %s: %s", origin, config)
    return config
