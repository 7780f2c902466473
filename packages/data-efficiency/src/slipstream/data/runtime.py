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
        """The curriculum loader when data_sampling's curriculum is on (else None)."""
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
