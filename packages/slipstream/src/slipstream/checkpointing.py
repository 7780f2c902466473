"""DeepSpeed's ``deepspeed.checkpointing``: activation checkpointing, from slipstream-pipeline.

>>> import slipstream.checkpointing as checkpointing
>>> checkpointing.configure(None, checkpoint_in_cpu=False).cpu_checkpointing
False
>>> checkpointing.reset()
"""

from __future__ import annotations

from slipstream.pipeline.checkpointing import (
    ActivationCheckpointingConfig,
    checkpoint,
    configure,
    get_config,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    profile_summary,
    reset,
)
from slipstream.pipeline.rng import RNGStatesTracker, get_rng_tracker

# DeepSpeed's names for the tracker.
get_cuda_rng_tracker = get_rng_tracker
CudaRNGStatesTracker = RNGStatesTracker

__all__ = [
    "ActivationCheckpointingConfig",
    "CudaRNGStatesTracker",
    "RNGStatesTracker",
    "checkpoint",
    "configure",
    "get_config",
    "get_cuda_rng_tracker",
    "get_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "profile_summary",
    "reset",
]
