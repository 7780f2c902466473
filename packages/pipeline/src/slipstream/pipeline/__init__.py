"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble) and activation checkpointing.

>>> import torch
>>> from slipstream.pipeline import LayerSpec, PipelineModule, build_schedule
>>> model = PipelineModule([LayerSpec(torch.nn.Linear, 8, 8) for _ in range(4)], num_stages=1)
>>> schedule = build_schedule("zero_bubble", num_stages=2, num_microbatches=8)
"""

from __future__ import annotations

from slipstream.comm.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessGrid,
    ProcessTopology,
)
from slipstream.pipeline.checkpointing import ActivationCheckpointingConfig, checkpoint, configure
from slipstream.pipeline.config import PipelineConfig
from slipstream.pipeline.executor import PipelineExecutor, PipelineResult
from slipstream.pipeline.gradients import (
    allreduce_data_parallel_gradients,
    clip_grad_norm_across_stages,
    reduce_tied_gradients,
)
from slipstream.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from slipstream.pipeline.p2p import StageCommunicator
from slipstream.pipeline.rng import get_rng_tracker, model_parallel_manual_seed
from slipstream.pipeline.runtime import build_executor, build_optimizer, eval_batch, train_batch
from slipstream.pipeline.schedules import (
    SCHEDULES,
    Instruction,
    Op,
    PipelineSchedule,
    ScheduleError,
    build_schedule,
    forward_only,
    simulate,
    theoretical_bubble_fraction,
)

__all__ = [
    "SCHEDULES",
    "ActivationCheckpointingConfig",
    "Instruction",
    "LayerSpec",
    "Op",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineConfig",
    "PipelineExecutor",
    "PipelineModule",
    "PipelineResult",
    "PipelineSchedule",
    "ProcessGrid",
    "ProcessTopology",
    "ScheduleError",
    "StageCommunicator",
    "TiedLayerSpec",
    "allreduce_data_parallel_gradients",
    "build_executor",
    "build_optimizer",
    "build_schedule",
    "checkpoint",
    "clip_grad_norm_across_stages",
    "configure",
    "eval_batch",
    "forward_only",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "reduce_tied_gradients",
    "simulate",
    "theoretical_bubble_fraction",
    "train_batch",
]
