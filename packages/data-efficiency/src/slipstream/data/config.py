"""Typed config blocks: legacy ``curriculum_learning`` and ``data_efficiency`` (DeepSpeed's keys)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

from slipstream.kernels.config_schema import ConfigBlock, ConfigError, config_fail, key_path

__all__ = [
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumScheduleConfig",
    "DataEfficiencyConfig",
    "DataRoutingConfig",
    "DataSamplingConfig",
    "DynamicBatchingConfig",
    "LayerTokenLRScheduleConfig",
    "RandomLTDConfig",
    "RandomLTDScheduleConfig",
    "RandomLTDScheduleSettings",
    "SamplingCurriculumConfig",
]

logger = logging.getLogger(__name__)

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]


@dataclasses.dataclass(kw_only=True)
class CurriculumScheduleConfig(ConfigBlock):
    """``schedule_config`` of a curriculum: which keys apply depends on ``schedule_type``.

    Attributes:
        total_curriculum_step: steps to go from min to max difficulty (fixed_linear/fixed_root).
        difficulty_step: every difficulty is a multiple of it (fixed_linear/fixed_root).
        root_degree: 2 = square root, 3 = cube root, 1 = linear (fixed_root).
        difficulty: the difficulties in order (fixed_discrete).
        max_step: the last step of each difficulty but the final one (fixed_discrete).
    """

    total_curriculum_step: int | None = dataclasses.field(default=None, metadata={"gt": 0})
    difficulty_step: int | None = dataclasses.field(default=None, metadata={"gt": 0})
    root_degree: float | None = dataclasses.field(default=None, metadata={"gt": 0})
    difficulty: list[int] | None = None
    max_step: list[int] | None = None


def _schedule_params(block: Any) -> dict[str, Any]:
    """A block's ``min/max_difficulty``, ``schedule_type`` and set ``schedule_config`` keys as
    the plain dict that CurriculumScheduler takes (the legacy block and each metric share it)."""
    return {
        "min_difficulty": block.min_difficulty,
        "max_difficulty": block.max_difficulty,
        "schedule_type": block.schedule_type,
        "schedule_config": {
            k: v for k, v in block.schedule_config.to_dict().items() if v is not None
        },
    }


def _check_schedule(
    path: str, schedule_type: str, schedule: CurriculumScheduleConfig, low: float, high: float
) -> None:
    """DeepSpeed's required keys per schedule type, as named errors instead of asserts."""
    where = key_path(path, "schedule_config")
    needs: dict[str, tuple[str, ...]] = {
        "fixed_linear": ("total_curriculum_step", "difficulty_step"),
        "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
        "fixed_discrete": ("difficulty", "max_step"),
        "custom": (),
    }
    for name in needs[schedule_type]:
        if getattr(schedule, name) is None:
            raise ConfigError(
                f"missing config key '{key_path(where, name)}': schedule_type "
                f'"{schedule_type}" needs {", ".join(needs[schedule_type])}',
                key_path(where, name),
            )
    if low > high:
        raise ConfigError(
            f"{key_path(path, 'min_difficulty')} = {low:g} is above "
            f"{key_path(path, 'max_difficulty')} = {high:g}; the curriculum goes from min up to max",
            key_path(path, "min_difficulty"),
        )
    if schedule_type == "fixed_discrete":
        assert schedule.difficulty is not None and schedule.max_step is not None
        if not schedule.difficulty or not schedule.max_step:
            config_fail(key_path(where, "difficulty"), schedule.difficulty, "non-empty lists")
        if len(schedule.difficulty) != len(schedule.max_step) + 1:
            raise ConfigError(
                f"{key_path(where, 'difficulty')} has {len(schedule.difficulty)} entries and "
                f"{key_path(where, 'max_step')} {len(schedule.max_step)}; max_step needs exactly "
                "one entry fewer (the last difficulty holds for every later step)",
                key_path(where, "max_step"),
            )
        if any(b <= a for a, b in zip(schedule.max_step, schedule.max_step[1:])):
            config_fail(key_path(where, "max_step"), schedule.max_step, "strictly increasing steps")
    elif schedule_type in ("fixed_linear", "fixed_root"):
        assert schedule.difficulty_step is not None
        if schedule.difficulty_step % 8 != 0:
            logger.warning(
                "%s = %d: with a seqlen metric a multiple of 8 (fp16) or 16 (int8) keeps "
                "tensor cores busy; ignore this for other metrics",
                key_path(where, "difficulty_step"),
                schedule.difficulty_step,
            )


@dataclasses.dataclass(kw_only=True)
class CurriculumLearningConfig(ConfigBlock):
    """The legacy top-level ``curriculum_learning`` block (DeepSpeed's first curriculum API).

    The engine advances the schedule each training forward (with ``global_steps + 1``) and, for
    ``curriculum_type`` ``"seqlen"``, passes ``curriculum_seqlen`` to the model when its forward
    takes it, or truncates the batch's sequence dimension to the current difficulty.

    Attributes:
        enabled: switch the curriculum on.
        curriculum_type: ``"seqlen"`` (applied by the engine) or another name (the schedule
            runs; the model reads it through ``engine.curriculum_difficulty()``).
        min_difficulty: the first difficulty.
        max_difficulty: the last difficulty.
        schedule_type: fixed_linear, fixed_root, fixed_discrete or custom.
        schedule_config: the schedule's parameters (see CurriculumScheduleConfig).
    """

    enabled: bool = False
    curriculum_type: str = "seqlen"
    min_difficulty: int = dataclasses.field(default=0, metadata={"ge": 0})
    max_difficulty: int = dataclasses.field(default=0, metadata={"ge": 0})
    schedule_type: ScheduleType = "fixed_linear"
    schedule_config: CurriculumScheduleConfig = dataclasses.field(
        default_factory=CurriculumScheduleConfig
    )

    @classmethod
    def from_dict(cls, data: Any, path: str = "") -> CurriculumLearningConfig:
        """Parse; an enabled block must name min/max difficulty and the schedule type."""
        if isinstance(data, dict) and data.get("enabled"):
            for name in ("min_difficulty", "max_difficulty", "schedule_type"):
                if name not in data:
                    raise ConfigError(
                        f"missing config key '{key_path(path, name)}': an enabled curriculum "
                        "needs min_difficulty, max_difficulty and schedule_type",
                        key_path(path, name),
                    )
        return super().from_dict(data, path)

    def validate(self, path: str) -> None:
        """The schedule's required keys and consistent bounds (when enabled); a seqlen
        curriculum may not start below one ``difficulty_step`` (it would round to 0 tokens)."""
        if self.enabled:
            _check_schedule(
                path,
                self.schedule_type,
                self.schedule_config,
                self.min_difficulty,
                self.max_difficulty,
            )
            step = self.schedule_config.difficulty_step
            if (
                self.curriculum_type == "seqlen"
                and self.schedule_type in ("fixed_linear", "fixed_root")
                and step is not None
                and self.min_difficulty < step
            ):
                raise ConfigError(
                    f"{key_path(path, 'min_difficulty')} = {self.min_difficulty} is below "
                    f"{key_path(path, 'schedule_config.difficulty_step')} = {step}: difficulties "
                    f"are rounded down to a multiple of {step}, so the first steps would get "
                    f"0-token sequences; raise min_difficulty to at least {step} or lower "
                    "difficulty_step",
                    key_path(path, "min_difficulty"),
                )

    def schedule_params(self) -> dict[str, Any]:
        """The schedule as the plain dict that CurriculumScheduler takes."""
        return _schedule_params(self)


@dataclasses.dataclass(kw_only=True)
class CurriculumMetricConfig(ConfigBlock):
    """One entry of ``data_sampling.curriculum_learning.curriculum_metrics``.

    Attributes:
        index_to_sample_path: prefix of the memory-mapped index (one row per metric value,
            holding the samples with that value, ascending), as DataAnalyzer writes it.
        index_to_metric_path: prefix of the metric value of each row (value-based only).
        difficulty_type: ``"value"`` (difficulty is a metric value) or ``"percentile"``
            (difficulty is a percentile of samples sorted by the metric).
        clustering_type: ``"schedule_based"`` (the metric selects samples) or
            ``"single_cluster"`` (the schedule runs, every sample is eligible).
        min_difficulty, max_difficulty, schedule_type, schedule_config: the schedule.
    """

    index_to_sample_path: str | None = None
    index_to_metric_path: str | None = None
    difficulty_type: Literal["value", "percentile"] = "value"
    clustering_type: Literal["schedule_based", "single_cluster"] = "schedule_based"
    min_difficulty: int = dataclasses.field(default=0, metadata={"ge": 0})
    max_difficulty: int
    schedule_type: ScheduleType
    schedule_config: CurriculumScheduleConfig = dataclasses.field(
        default_factory=CurriculumScheduleConfig
    )

    def validate(self, path: str) -> None:
        """Schedule keys, bounds, and the index paths a schedule-based metric needs."""
        _check_schedule(
            path, self.schedule_type, self.schedule_config, self.min_difficulty, self.max_difficulty
        )
        if self.clustering_type == "schedule_based":
            needed = ["index_to_sample_path"]
            if self.difficulty_type == "value":
                needed.append("index_to_metric_path")
            for name in needed:
                if getattr(self, name) is None:
                    raise ConfigError(
                        f"missing config key '{key_path(path, name)}': a schedule_based "
                        f'metric with difficulty_type "{self.difficulty_type}" reads it (write '
                        "the index files with slipstream.data.DataAnalyzer)",
                        key_path(path, name),
                    )
        if self.difficulty_type == "percentile" and self.max_difficulty > 100:
            config_fail(
                key_path(path, "max_difficulty"), self.max_difficulty, "a percentile <= 100"
            )

    def schedule_params(self) -> dict[str, Any]:
        """The schedule as the plain dict that CurriculumScheduler takes."""
        return _schedule_params(self)


@dataclasses.dataclass(kw_only=True)
class SamplingCurriculumConfig(ConfigBlock):
    """``data_sampling.curriculum_learning``: curricula over difficulty metrics of the data.

    Attributes:
        enabled: sample each global batch from the current difficulty range.
        data_cluster_path: where DeepSpeed writes its cluster files; accepted for config
            compatibility (Slipstream keeps the eligible index in memory; see the docs).
        curriculum_metrics: metric name -> its index files and schedule.
    """

    enabled: bool = False
    data_cluster_path: str | None = None
    curriculum_metrics: dict[str, CurriculumMetricConfig] = dataclasses.field(default_factory=dict)

    def validate(self, path: str) -> None:
        """An enabled curriculum needs at least one metric."""
        if self.enabled and not self.curriculum_metrics:
            where = key_path(path, "curriculum_metrics")
            raise ConfigError(
                f"{key_path(path, 'enabled')} is true but '{where}' names no metric; add one",
                where,
            )


@dataclasses.dataclass(kw_only=True)
class DynamicBatchingConfig(ConfigBlock):
    """``data_sampling.dynamic_batching`` (DeepSpeed's keys and defaults).

    Attributes:
        enabled: pack micro-batches by token count; the engine's training loader then
            gives each rank variable-size micro-batches, and each step's LR is scaled by that
            global batch's sample count against ``train_batch_size``.
        lr_scaling_method: ``linear``, ``sqrt`` or ``none``.
        min_batch_size, max_batch_size: bounds on samples per micro-batch.
        sequence_picking_order: ``dataloader``, ``random`` or ``seqlen``.
        max_tokens: the summed length a micro-batch may hold (required when enabled).
        verbose: log each batch.
        metrics_path: where DeepSpeed's data analyzer wrote the ``seqlen`` metric (its
            ``seqlen/seqlen_sample_to_metric`` files); unset: the lengths are measured from
            the dataset's samples.
    """

    enabled: bool = False
    lr_scaling_method: Literal["linear", "sqrt", "none"] = "linear"
    min_batch_size: int = dataclasses.field(default=1, metadata={"gt": 0})
    max_batch_size: int | None = dataclasses.field(default=None, metadata={"gt": 0})
    sequence_picking_order: Literal["dataloader", "random", "seqlen"] = "dataloader"
    max_tokens: int | None = dataclasses.field(default=None, metadata={"gt": 0})
    verbose: bool = False
    metrics_path: str | None = None

    def validate(self, path: str) -> None:
        """An enabled block needs max_tokens (as DeepSpeed asserts); batch bounds agree."""
        if not self.enabled:
            return
        if self.max_tokens is None:
            raise ConfigError(
                f"missing config key '{key_path(path, 'max_tokens')}': dynamic batching packs "
                "each micro-batch up to that many tokens",
                key_path(path, "max_tokens"),
            )
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            config_fail(
                key_path(path, "max_batch_size"),
                self.max_batch_size,
                f"at least min_batch_size ({self.min_batch_size})",
            )


@dataclasses.dataclass(kw_only=True)
class DataSamplingConfig(ConfigBlock):
    """``data_efficiency.data_sampling``.

    Attributes:
        enabled: use the difficulty-based sampler for the training loader.
        num_epochs: passes over the data the sampler may make (DeepSpeed's default 1000).
        num_workers: DataLoader worker processes.
        pin_memory: DataLoader pin_memory.
        curriculum_learning: the metric curricula.
    """

    enabled: bool = False
    num_epochs: int = dataclasses.field(default=1000, metadata={"gt": 0})
    num_workers: int = dataclasses.field(default=0, metadata={"ge": 0})
    pin_memory: bool = False
    curriculum_learning: SamplingCurriculumConfig = dataclasses.field(
        default_factory=SamplingCurriculumConfig
    )
    dynamic_batching: DynamicBatchingConfig = dataclasses.field(
        default_factory=DynamicBatchingConfig
    )

    def validate(self, path: str) -> None:
        """Dynamic batching and the difficulty sampler both build the loader: one of them."""
        if self.dynamic_batching.enabled and self.curriculum_learning.enabled:
            raise ConfigError(
                f"{key_path(path, 'dynamic_batching.enabled')} and "
                f"{key_path(path, 'curriculum_learning.enabled')} are both true: each builds "
                "the training loader's sampler, and they are not composed; turn one off",
                key_path(path, "dynamic_batching.enabled"),
            )


@dataclasses.dataclass(kw_only=True)
class RandomLTDScheduleSettings(ConfigBlock):
    """``random_ltd_schedule.schedule_config``.

    Attributes:
        require_steps: steps to grow the kept tokens from min_value to max_value.
        seq_per_step: the kept-token count is a multiple of it.
    """

    require_steps: int = dataclasses.field(metadata={"gt": 0})
    seq_per_step: int = dataclasses.field(default=8, metadata={"gt": 0})


@dataclasses.dataclass(kw_only=True)
class RandomLTDScheduleConfig(ConfigBlock):
    """``random_ltd.random_ltd_schedule``: how many tokens the dropping layers keep.

    Attributes:
        min_value: tokens kept at step 0.
        max_value: tokens kept at the end (the full sequence length).
        schedule_type: only ``"fixed_linear"`` (as in DeepSpeed).
        schedule_config: require_steps and seq_per_step.
    """

    min_value: int = dataclasses.field(metadata={"gt": 0})
    max_value: int = dataclasses.field(metadata={"gt": 0})
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleSettings

    def validate(self, path: str) -> None:
        """min_value may not exceed max_value, nor lie below one seq_per_step (the first kept
        count, rounded down to a multiple of it, would be 0 tokens)."""
        if self.min_value > self.max_value:
            raise ConfigError(
                f"{key_path(path, 'min_value')} = {self.min_value} is above "
                f"{key_path(path, 'max_value')} = {self.max_value}",
                key_path(path, "min_value"),
            )
        step = self.schedule_config.seq_per_step
        if self.min_value < step:
            raise ConfigError(
                f"{key_path(path, 'min_value')} = {self.min_value} is below "
                f"{key_path(path, 'schedule_config.seq_per_step')} = {step}: the kept-token "
                f"count is rounded down to a multiple of {step}, so the layers would keep 0 "
                f"tokens; raise min_value to at least {step} or lower seq_per_step",
                key_path(path, "min_value"),
            )


@dataclasses.dataclass(kw_only=True)
class LayerTokenLRScheduleConfig(ConfigBlock):
    """``random_ltd.layer_token_lr_schedule``: LR warmup and decay over layer-tokens.

    Random-LTD layers see fewer tokens early on, so DeepSpeed decays the LR over consumed
    layer-tokens instead of steps. Slipstream implements it (DeepSpeed refuses it).

    Attributes:
        enabled: replace the engine's LR schedule by the layer-token one.
        total_layer_tokens: layer-tokens at which the LR reaches ``min_lr``.
        warmup_type: ``"linear"`` or ``"log"`` warmup.
        warmup_layer_tokens: layer-tokens of warmup.
        decay_style: ``"cosine"`` or ``"linear"`` decay after warmup (Slipstream key).
        min_lr: the floor of the decay (Slipstream key).
    """

    enabled: bool = False
    total_layer_tokens: int | None = dataclasses.field(default=None, metadata={"gt": 0})
    warmup_type: Literal["linear", "log"] = "linear"
    warmup_layer_tokens: int = dataclasses.field(default=0, metadata={"ge": 0})
    decay_style: Literal["cosine", "linear"] = "cosine"
    min_lr: float = dataclasses.field(default=0.0, metadata={"ge": 0})

    def validate(self, path: str) -> None:
        """An enabled schedule needs total_layer_tokens above the warmup."""
        if not self.enabled:
            return
        if self.total_layer_tokens is None:
            raise ConfigError(
                f"missing config key '{key_path(path, 'total_layer_tokens')}': the layer-token "
                "LR schedule decays over that many layer-tokens",
                key_path(path, "total_layer_tokens"),
            )
        if self.total_layer_tokens <= self.warmup_layer_tokens:
            config_fail(
                key_path(path, "total_layer_tokens"),
                self.total_layer_tokens,
                f"more than warmup_layer_tokens ({self.warmup_layer_tokens})",
            )


@dataclasses.dataclass(kw_only=True)
class RandomLTDConfig(ConfigBlock):
    """``data_routing.random_ltd``: random layerwise token dropping.

    Attributes:
        enabled: drop tokens in the listed layers.
        total_layer_num: transformer layers of the model.
        random_ltd_layer_num: how many of them drop tokens.
        random_ltd_layer_id: their indices (the model's layer numbering).
        model_mask_name: the keyword of the layer's attention mask, or null.
        model_type: ``"decoder"`` (causal mask: the kept prefix of the mask) or
            ``"encoder"`` (the mask's kept rows and columns).
        hidden_state_order: ``"batch_seq_dim"`` or ``"seq_batch_dim"``.
        random_ltd_schedule: kept-token schedule.
        layer_token_lr_schedule: LR schedule over consumed layer-tokens.
    """

    enabled: bool = False
    total_layer_num: int = dataclasses.field(default=0, metadata={"ge": 0})
    random_ltd_layer_num: int = dataclasses.field(default=0, metadata={"ge": 0})
    random_ltd_layer_id: list[int] = dataclasses.field(default_factory=list)
    model_mask_name: str | None = None
    model_type: Literal["decoder", "encoder"] = "decoder"
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    random_ltd_schedule: RandomLTDScheduleConfig | None = None
    layer_token_lr_schedule: LayerTokenLRScheduleConfig = dataclasses.field(
        default_factory=LayerTokenLRScheduleConfig
    )

    def validate(self, path: str) -> None:
        """Layer counts agree with the layer ids; an enabled block has a schedule."""
        if not self.enabled:
            return
        if self.random_ltd_schedule is None:
            raise ConfigError(
                f"missing config key '{key_path(path, 'random_ltd_schedule')}': random-LTD "
                "needs min_value, max_value and schedule_config.require_steps",
                key_path(path, "random_ltd_schedule"),
            )
        if len(self.random_ltd_layer_id) != self.random_ltd_layer_num:
            raise ConfigError(
                f"{key_path(path, 'random_ltd_layer_num')} = {self.random_ltd_layer_num} but "
                f"{key_path(path, 'random_ltd_layer_id')} lists {len(self.random_ltd_layer_id)} "
                "layers; they must agree",
                key_path(path, "random_ltd_layer_num"),
            )
        if self.random_ltd_layer_num > self.total_layer_num:
            config_fail(
                key_path(path, "random_ltd_layer_num"),
                self.random_ltd_layer_num,
                f"at most total_layer_num ({self.total_layer_num})",
            )


@dataclasses.dataclass(kw_only=True)
class DataRoutingConfig(ConfigBlock):
    """``data_efficiency.data_routing``.

    Attributes:
        enabled: switch data routing on.
        random_ltd: random layerwise token dropping.
    """

    enabled: bool = False
    random_ltd: RandomLTDConfig = dataclasses.field(default_factory=RandomLTDConfig)


@dataclasses.dataclass(kw_only=True)
class DataEfficiencyConfig(ConfigBlock):
    """The ``data_efficiency`` block: data sampling (curricula) and data routing (random-LTD).

    A feature runs only when its own ``enabled`` and every enclosing ``enabled`` are true,
    as in DeepSpeed.

    Attributes:
        enabled: switch the library on.
        seed: seed of the sampler's shuffles and of random-LTD's token choice.
        data_sampling: difficulty-based sampling.
        data_routing: random-LTD.
    """

    enabled: bool = False
    seed: int = 1234
    data_sampling: DataSamplingConfig = dataclasses.field(default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = dataclasses.field(default_factory=DataRoutingConfig)

    @property
    def sampling_curriculum_enabled(self) -> bool:
        """Whether the difficulty-based sampler is on."""
        sampling = self.data_sampling
        return self.enabled and sampling.enabled and sampling.curriculum_learning.enabled

    @property
    def dynamic_batching_enabled(self) -> bool:
        """Whether dynamic batching builds the training loader."""
        sampling = self.data_sampling
        return self.enabled and sampling.enabled and sampling.dynamic_batching.enabled

    @property
    def random_ltd_enabled(self) -> bool:
        """Whether random-LTD is on."""
        routing = self.data_routing
        return self.enabled and routing.enabled and routing.random_ltd.enabled
