"""Activation checkpointing: recompute a block's forward in backward instead of storing it.

DeepSpeed's ``deepspeed.checkpointing`` API (``checkpoint``, ``configure``, the
``activation_checkpointing`` config block, ``model_parallel_cuda_manual_seed``) on top of
``torch.utils.checkpoint``. Non-reentrant by default (it supports inputs that do not require
grad, keyword arguments and nested checkpoints); the RNG streams of
:mod:`slipstream.pipeline.rng` are replayed on recomputation, as are torch's own generators,
so dropout draws the same mask twice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from slipstream.comm.tensor_parallel import (
    gather_flat_from_tensor_parallel_region,
    split_flat_to_tensor_parallel_region,
)
from slipstream.kernels.config_schema import ConfigBlock
from slipstream.pipeline.rng import get_rng_tracker, model_parallel_manual_seed

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointProfile",
    "checkpoint",
    "configure",
    "get_config",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "profile_summary",
    "reset",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class ActivationCheckpointingConfig(ConfigBlock):
    """The ``activation_checkpointing`` block, DeepSpeed's keys and defaults.

    - ``partition_activations``: split each checkpoint's saved floating-point inputs across the
      tensor-parallel group of the ``mpu`` given to :func:`configure` (each rank keeps 1/tp,
      flattened); the recomputation all-gathers them. The inputs must be equal on every rank
      of the group (activations between tensor-parallel blocks are). A no-op with one rank.
    - ``cpu_checkpointing``: keep the saved inputs in host memory, copying them back for the
      recomputation (frees accelerator memory at the cost of two copies per checkpoint).
    - ``contiguous_memory_optimization``: in DeepSpeed, copies the *partitioned* activations
      into one preallocated buffer against fragmentation. Accepted and logged as having no
      effect: each partitioned activation keeps its own allocation.
    - ``number_checkpoints``: the buffer size for the above; accepted and unused.
    - ``synchronize_checkpoint_boundary``: synchronise the accelerator before and after each
      checkpointed forward (for timing and debugging).
    - ``profile``: time each checkpointed forward and recomputation (:func:`profile_summary`).

    >>> ActivationCheckpointingConfig.from_dict({"cpu_checkpointing": True}).cpu_checkpointing
    True
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = dataclasses.field(default=None, metadata={"ge": 1})
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclasses.dataclass
class CheckpointProfile:
    """Accumulated timings of checkpointed blocks (when ``profile`` is on)."""

    forward_calls: int = 0
    forward_seconds: float = 0.0
    recompute_calls: int = 0
    recompute_seconds: float = 0.0


_config = ActivationCheckpointingConfig()
_configured = False
_tensor_parallel_size = 1
_tensor_parallel_group: Any = None
_profile = CheckpointProfile()


def configure(
    mpu_: Any = None,
    deepspeed_config: Mapping[str, Any] | ActivationCheckpointingConfig | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> ActivationCheckpointingConfig:
    """Set the process-wide checkpointing options (DeepSpeed's ``checkpointing.configure``).

    ``deepspeed_config`` is a whole config dict (its ``activation_checkpointing`` block is
    read), the block itself as a dict, or an :class:`ActivationCheckpointingConfig`; the keyword
    arguments override it. ``mpu_`` is anything with ``get_model_parallel_world_size()`` (a
    :class:`slipstream.comm.topology.ProcessGrid`). Returns the resulting config.

    >>> configure(checkpoint_in_cpu=True).cpu_checkpointing
    True
    >>> reset()
    """
    global _config, _configured, _tensor_parallel_size, _tensor_parallel_group
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        base = deepspeed_config.to_dict()
    elif deepspeed_config is None:
        base = {}
    elif isinstance(deepspeed_config, Mapping):
        block = deepspeed_config.get("activation_checkpointing", None)
        base = dict(block) if isinstance(block, Mapping) else dict(deepspeed_config)
    else:
        raise TypeError(
            "deepspeed_config must be a config dict or an ActivationCheckpointingConfig, got "
            f"{type(deepspeed_config).__name__}; read JSON files with "
            "slipstream.config.loading.read_config_source first"
        )
    overrides = {
        "partition_activations": partition_activations,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    base.update({k: v for k, v in overrides.items() if v is not None})
    config = ActivationCheckpointingConfig.from_dict(base, "activation_checkpointing")
    tp_size = int(mpu_.get_model_parallel_world_size()) if mpu_ is not None else 1
    tp_group = None
    if tp_size > 1 and config.partition_activations:
        if not hasattr(mpu_, "get_model_parallel_group"):
            raise TypeError(
                "activation_checkpointing.partition_activations with a tensor-parallel size of "
                f"{tp_size} needs an mpu with get_model_parallel_group() (a slipstream.comm."
                f"topology.ProcessGrid); {type(mpu_).__name__} has none"
            )
        tp_group = mpu_.get_model_parallel_group()
    if config.contiguous_memory_optimization:
        logger.info(
            "activation_checkpointing.contiguous_memory_optimization has no effect: each "
            "partitioned activation keeps its own allocation (no preallocated buffer)"
        )
    _config, _configured, _tensor_parallel_size = config, True, tp_size
    _tensor_parallel_group = tp_group
    return config


def reset() -> None:
    """Back to the defaults (no CPU checkpointing, no profiling) and clear the profile."""
    global _config, _configured, _tensor_parallel_size, _tensor_parallel_group, _profile
    _config, _configured, _tensor_parallel_size = ActivationCheckpointingConfig(), False, 1
    _tensor_parallel_group = None
    _profile = CheckpointProfile()


def is_configured() -> bool:
    """Whether :func:`configure` has run (DeepSpeed's ``checkpointing.is_configured``)."""
    return _configured


def get_config() -> ActivationCheckpointingConfig:
    """The options in force."""
    return _config


def profile_summary() -> CheckpointProfile:
    """Timings gathered while ``profile`` was on (each recomputation also logs them at DEBUG)."""
    return dataclasses.replace(_profile)


def model_parallel_cuda_manual_seed(seed: int, tensor_parallel_rank: int = 0) -> None:
    """DeepSpeed's name for :func:`slipstream.pipeline.rng.model_parallel_manual_seed`."""
    model_parallel_manual_seed(seed, tensor_parallel_rank)


def _synchronize(tensors: tuple[Any, ...]) -> None:
    for value in tensors:
        if isinstance(value, torch.Tensor) and value.device.type == "cuda":
            torch.cuda.synchronize(value.device)
            return


def _offload(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[torch.device | None]]:
    # `.to("cpu")` is differentiable and saves nothing for backward, so the checkpoint keeps
    # only the host copy, and gradients still reach the caller's tensor through the copy.
    moved: list[Any] = []
    devices: list[torch.device | None] = []
    for value in args:
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            devices.append(value.device)
            moved.append(value.to("cpu", non_blocking=False))
        else:
            devices.append(None)
            moved.append(value)
    return tuple(moved), devices


def _partition(args: tuple[Any, ...], group: Any) -> tuple[tuple[Any, ...], list[Any]]:
    parts: list[Any] = []
    shapes: list[torch.Size | None] = []
    for value in args:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            shapes.append(value.shape)
            parts.append(split_flat_to_tensor_parallel_region(value, group))
        else:
            shapes.append(None)
            parts.append(value)
    return tuple(parts), shapes


def checkpoint(
    function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any
) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its intermediate activations.

    In backward the forward is recomputed with every RNG (torch's CPU and accelerator
    generators, and the tracker's named streams) rewound to where it was, so dropout repeats
    exactly and the gradients equal those of an uncheckpointed run. Options set by
    :func:`configure` apply (``cpu_checkpointing``, ``synchronize_checkpoint_boundary``,
    ``profile``).

    >>> layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> checkpoint(layer, x).sum().backward()
    >>> x.grad.shape
    torch.Size([2, 4])
    """
    config = _config
    tracker = get_rng_tracker()
    recorded = tracker.get_states()
    calls = 0

    def replaying(*inner: Any, **inner_kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if config.cpu_checkpointing:
            inner = tuple(
                value.to(device) if device is not None else value
                for value, device in zip(inner, devices)
            )
        if shapes:
            inner = tuple(
                gather_flat_from_tensor_parallel_region(value, shape, group)
                if shape is not None
                else value
                for value, shape in zip(inner, shapes)
            )
        start = time.perf_counter() if config.profile else 0.0
        if calls == 1:
            if offloaded_from_cuda:
                # torch stashes the generators of the *arguments'* device, which are on the
                # host now; stash the accelerator's generator here instead.
                device_rng.append(torch.cuda.get_rng_state())
            result = function(*inner, **inner_kwargs)
            if config.profile:
                _profile.forward_calls += 1
                _profile.forward_seconds += time.perf_counter() - start
            return result
        # A recomputation: replay the tracker's streams from where the forward found them.
        current = tracker.get_states()
        tracker.set_states(recorded)
        outer_device_rng = torch.cuda.get_rng_state() if device_rng else None
        if device_rng:
            torch.cuda.set_rng_state(device_rng[0])
        try:
            return function(*inner, **inner_kwargs)
        finally:
            tracker.set_states(current)
            if outer_device_rng is not None:
                torch.cuda.set_rng_state(outer_device_rng)
            if config.profile:
                _profile.recompute_calls += 1
                _profile.recompute_seconds += time.perf_counter() - start
                logger.debug("checkpoint profile: %s", _profile)

    devices: list[torch.device | None] = []
    device_rng: list[torch.Tensor] = []
    shapes: list[torch.Size | None] = []
    group = _tensor_parallel_group
    if config.partition_activations and _tensor_parallel_size > 1:
        # Each tensor-parallel rank keeps 1/tp of every floating-point input (they are
        # replicated across the group); the recomputation all-gathers them back.
        args, shapes = _partition(args, group)
    if config.cpu_checkpointing:
        args, devices = _offload(args)
    offloaded_from_cuda = any(d is not None and d.type == "cuda" for d in devices)
    if config.synchronize_checkpoint_boundary:
        _synchronize(args)
    result = torch_checkpoint.checkpoint(
        replaying, *args, use_reentrant=use_reentrant, preserve_rng_state=True, **kwargs
    )
    if config.synchronize_checkpoint_boundary:
        _synchronize(args)
    return result


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's ``non_reentrant_checkpoint``: :func:`checkpoint` with ``use_reentrant=False``."""
    return checkpoint(function, *args, use_reentrant=False)
