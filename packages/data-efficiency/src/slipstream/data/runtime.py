"""DataEfficiency: the one object an engine holds for curricula, the sampler and random-LTD."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from slipstream.data.config import CurriculumLearningConfig, DataEfficiencyConfig
from slipstream.data.curriculum import CurriculumScheduler
from slipstream.data.dynamic_batching import DynamicBatchSampler, dataset_seqlens, scale_lr
from slipstream.data.random_ltd.attach import attach_random_ltd
from slipstream.data.random_ltd.lr_schedule import LayerTokenLR
from slipstream.data.random_ltd.scheduler import RandomLTDScheduler
from slipstream.data.sampler import (
    CurriculumDataLoader,
    CurriculumSampler,
    PostProcess,
    build_curriculum_dataloader,
)
from slipstream.data.seqlen import apply_seqlen_curriculum

__all__ = ["STATE_KEY", "DataEfficiency"]

logger = logging.getLogger(__name__)

# The key under which an engine's checkpoint carries this state (inside its client state).
STATE_KEY = "slipstream.data"


class DataEfficiency:
    """Holds the legacy curriculum, the difficulty sampler and random-LTD of one engine.

    The engine calls :meth:`before_forward` on every training forward (it advances the
    schedules with DeepSpeed's step numbering and applies the seqlen curriculum), and hands
    :meth:`state_dict`/:meth:`load_state_dict` to its checkpoints.

    Args:
        curriculum: the legacy ``curriculum_learning`` block.
        data_efficiency: the ``data_efficiency`` block.
        global_batch_size, micro_batch_size: the engine's batch sizes.
    """

    def __init__(
        self,
        curriculum: CurriculumLearningConfig,
        data_efficiency: DataEfficiencyConfig,
        *,
        global_batch_size: int,
        micro_batch_size: int,
    ) -> None:
        self.curriculum_config = curriculum
        self.config = data_efficiency
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.curriculum_type = curriculum.curriculum_type
        self.curriculum: CurriculumScheduler | None = (
            CurriculumScheduler(curriculum.schedule_params()) if curriculum.enabled else None
        )
        self.random_ltd: RandomLTDScheduler | None = (
            RandomLTDScheduler(data_efficiency.data_routing.random_ltd, global_batch_size)
            if data_efficiency.random_ltd_enabled
            else None
        )
        self.sampler: CurriculumSampler | None = None
        self.loader: CurriculumDataLoader | None = None
        self.post_process: PostProcess | None = None
        self.layer_token_lr: LayerTokenLR | None = None
        # Dynamic batching: the loader's sampler, and the global batches the engine stepped
        # on since the loader started (the step -> batch map behind LR scaling and resume).
        self.dynamic_sampler: DynamicBatchSampler | None = None
        self.consumed_batches = 0

    @classmethod
    def from_configs(
        cls,
        curriculum: CurriculumLearningConfig,
        data_efficiency: DataEfficiencyConfig,
        *,
        global_batch_size: int,
        micro_batch_size: int,
    ) -> DataEfficiency | None:
        """The runtime, or None when every feature is off (the engine then does nothing)."""
        if not (
            curriculum.enabled
            or data_efficiency.sampling_curriculum_enabled
            or data_efficiency.random_ltd_enabled
            or data_efficiency.dynamic_batching_enabled
        ):
            return None
        return cls(
            curriculum,
            data_efficiency,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
        )

    # ------------------------------------------------------------------ legacy curriculum
    def set_curriculum_learning_params(
        self,
        curriculum_type: str = "seqlen",
        min_difficulty: int | None = None,
        max_difficulty: int | None = None,
        schedule_type: str = "fixed_linear",
        schedule_config: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> None:
        """(Re)configure the legacy curriculum in code, as the seeds' guide writes it."""
        if extra:
            raise TypeError(
                f"set_curriculum_learning_params() got unknown arguments {sorted(extra)}; it "
                "takes curriculum_type, min_difficulty, max_difficulty, schedule_type and "
                "schedule_config"
            )
        self.curriculum_type = curriculum_type
        self.curriculum = CurriculumScheduler(
            {
                "min_difficulty": min_difficulty,
                "max_difficulty": max_difficulty,
                "schedule_type": schedule_type,
                "schedule_config": dict(schedule_config or {}),
            }
        )

    def set_custom_curriculum_learning_schedule(
        self, schedule_functions: Mapping[str, Callable[[int], int]]
    ) -> None:
        """Difficulty functions for ``custom`` schedules (legacy curriculum: any key)."""
        if self.sampler is not None:
            self.sampler.set_custom_curriculum_learning_schedule(schedule_functions)
        if self.curriculum is not None and schedule_functions:
            function = schedule_functions.get(
                self.curriculum_type, next(iter(schedule_functions.values()))
            )
            self.curriculum.set_custom_get_difficulty(function)

    def curriculum_difficulty(self) -> int | None:
        """The legacy curriculum's current difficulty (None without one)."""
        return None if self.curriculum is None else self.curriculum.get_current_difficulty()

    # ------------------------------------------------------------------ per forward
    def before_forward(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        global_steps: int,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Advance the schedules for a training forward and apply the seqlen curriculum.

        As in DeepSpeed: the legacy curriculum moves to step ``global_steps + 1``, random-LTD
        to ``global_steps``.
        """
        if self.curriculum is not None:
            difficulty = self.curriculum.update_difficulty(global_steps + 1)
            if self.curriculum_type == "seqlen":
                args, kwargs = apply_seqlen_curriculum(module, args, kwargs, difficulty)
        if self.random_ltd is not None:
            self.random_ltd.update_seq(global_steps)
            self.random_ltd.sample_indices = None  # fresh tokens for this forward
            self.random_ltd.sample_rows = None
        return args, kwargs

    # ------------------------------------------------------------------ random-LTD
    def attach_random_ltd(self, module: nn.Module) -> list[str]:
        """Give the wrapped layers of ``module`` the random-LTD scheduler."""
        if self.random_ltd is None:
            raise RuntimeError(
                "random_ltd_initialize(): random-LTD is off in this config; enable "
                "data_efficiency.enabled, data_routing.enabled and data_routing.random_ltd.enabled"
            )
        return attach_random_ltd(module, self.config.data_routing.random_ltd, self.random_ltd)

    def layer_token_schedule(
        self, optimizer: torch.optim.Optimizer | None, client_scheduler: Any
    ) -> LayerTokenLR | None:
        """The layer-token LR schedule when the config asks for it (else None)."""
        settings = self.config.data_routing.random_ltd.layer_token_lr_schedule
        if self.random_ltd is None or not settings.enabled:
            return None
        if client_scheduler is not None:
            raise ValueError(
                "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule.enabled is "
                "true, and an LR scheduler was also given (initialize(lr_scheduler=...) or the "
                "'scheduler' block); keep one of them"
            )
        if optimizer is None:
            raise ValueError("the layer-token LR schedule needs an optimizer")
        self.layer_token_lr = LayerTokenLR(optimizer, self.random_ltd, settings)
        return self.layer_token_lr

    # ------------------------------------------------------------------ data sampling
    def set_data_post_process_func(self, post_process: PostProcess | None) -> None:
        """``fn(batch, sampler_progress) -> batch`` applied to every batch of the curriculum
        loader (DeepSpeed's ``set_data_post_process_func``)."""
        self.post_process = post_process
        if self.loader is not None:
            self.loader.post_process = post_process

    def build_dataloader(
        self,
        dataset: Dataset,
        *,
        data_parallel_rank: int,
        data_parallel_size: int,
        gradient_accumulation_steps: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> DataLoader | None:
        """The curriculum or dynamic-batching loader when one is on (else None)."""
        if self.config.dynamic_batching_enabled:
            return self._build_dynamic_dataloader(
                dataset,
                data_parallel_rank=data_parallel_rank,
                data_parallel_size=data_parallel_size,
                gradient_accumulation_steps=gradient_accumulation_steps,
                collate_fn=collate_fn,
            )
        if not self.config.sampling_curriculum_enabled:
            return None
        self.sampler = CurriculumSampler(
            self.config,
            len(dataset),  # type: ignore[arg-type]
            micro_batch_size=self.micro_batch_size,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )
        sampling = self.config.data_sampling
        self.loader = build_curriculum_dataloader(
            dataset,
            self.sampler,
            collate_fn=collate_fn,
            num_workers=sampling.num_workers,
            pin_memory=sampling.pin_memory,
            post_process=self.post_process,
        )
        return self.loader

    def _build_dynamic_dataloader(
        self,
        dataset: Dataset,
        *,
        data_parallel_rank: int,
        data_parallel_size: int,
        gradient_accumulation_steps: int,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> DataLoader:
        sampling = self.config.data_sampling
        settings = sampling.dynamic_batching
        assert settings.max_tokens is not None  # the config requires it when enabled
        self.dynamic_sampler = DynamicBatchSampler(
            dataset_seqlens(dataset, settings.metrics_path),
            settings.max_tokens,
            data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            min_batch_size=settings.min_batch_size,
            max_batch_size=settings.max_batch_size,
            sequence_picking_order=settings.sequence_picking_order,
            seed=self.config.seed,
        )
        self.dynamic_sampler.seek(self.consumed_batches)  # a checkpoint loaded before
        if settings.verbose:
            sizes = self.dynamic_sampler.batch_sizes(0)
            logger.info(
                "dynamic batching: %d global batches in epoch 0, %d-%d samples each "
                "(base batch size %d, LR scaling %s)",
                len(sizes),
                min(sizes),
                max(sizes),
                self.global_batch_size,
                settings.lr_scaling_method,
            )
        return DataLoader(
            dataset,
            batch_sampler=self.dynamic_sampler,
            collate_fn=collate_fn,
            num_workers=sampling.num_workers,
            pin_memory=sampling.pin_memory,
        )

    # ------------------------------------------------------------------ dynamic batching
    def dynamic_batch_samples(self) -> int | None:
        """Samples in the global batch the engine steps on now (None without dynamic batching).

        Step ``k`` after the loader started reads its ``k``-th global batch: every rank knows
        every batch's size without communication (they pack identically).
        """
        if self.dynamic_sampler is None:
            return None
        return self.dynamic_sampler.global_batch_size(self.consumed_batches)

    def dynamic_lr_factor(self) -> float | None:
        """The LR multiplier of the current global batch (None without dynamic batching)."""
        samples = self.dynamic_batch_samples()
        if samples is None:
            return None
        method = self.config.data_sampling.dynamic_batching.lr_scaling_method
        return scale_lr(self.global_batch_size, samples, 1.0, method)

    def after_step(self) -> None:
        """The engine finished an optimizer step (taken or skipped): one global batch used."""
        if self.dynamic_sampler is not None:
            self.consumed_batches += 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Curriculum, random-LTD, LR and sampler state (JSON-ready)."""
        return {
            "curriculum_type": self.curriculum_type,
            "curriculum": None if self.curriculum is None else self.curriculum.state_dict(),
            "random_ltd": None if self.random_ltd is None else self.random_ltd.state_dict(),
            "layer_token_lr": (
                None if self.layer_token_lr is None else self.layer_token_lr.state_dict()
            ),
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "dynamic_batching": (
                None
                if self.dynamic_sampler is None
                else {"consumed_batches": self.consumed_batches}
            ),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what state_dict() returned (parts this runtime lacks are skipped)."""
        self.curriculum_type = state.get("curriculum_type", self.curriculum_type)
        if state.get("curriculum") is not None:
            if self.curriculum is None:
                self.curriculum = CurriculumScheduler(state["curriculum"])
            self.curriculum.load_state_dict(state["curriculum"])
        if self.random_ltd is not None and state.get("random_ltd") is not None:
            self.random_ltd.load_state_dict(state["random_ltd"])
        if self.layer_token_lr is not None and state.get("layer_token_lr") is not None:
            self.layer_token_lr.load_state_dict(state["layer_token_lr"])
        if self.sampler is not None and state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        dynamic = state.get("dynamic_batching")
        if dynamic is not None and self.config.dynamic_batching_enabled:
            # The loader may be built before or after the load: seek now and on building.
            self.consumed_batches = int(dynamic["consumed_batches"])
            if self.dynamic_sampler is not None:
                self.dynamic_sampler.seek(self.consumed_batches)
