"""The few accelerator facts comm needs (backend, device count, set device, synchronise)."""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _accelerator() -> Any | None:
    """`slipstream.kernels.get_accelerator()`, or None where kernels is not importable."""
    try:
        from slipstream.kernels import get_accelerator
    except ImportError:
        return None
    return get_accelerator()


def device_type() -> str:
    """torch's device type of the accelerator: ``"cuda"`` (CUDA and ROCm) or ``"cpu"``."""
    accelerator = _accelerator()
    if accelerator is not None:
        return str(accelerator.device_type)
    return "cuda" if torch.cuda.is_available() else "cpu"


def accelerator_name() -> str:
    """``"cuda"``, ``"rocm"`` or ``"cpu"``."""
    accelerator = _accelerator()
    if accelerator is not None:
        return str(accelerator.name)
    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    return "cpu"


def communication_backend() -> str:
    """The collective backend that fits the accelerator: nccl (also RCCL on ROCm) or gloo."""
    accelerator = _accelerator()
    if accelerator is not None:
        return str(accelerator.communication_backend)
    return "nccl" if torch.cuda.is_available() else "gloo"


def device_count() -> int:
    """Number of visible accelerator devices (0 on CPU)."""
    if device_type() == "cpu":
        return 0
    accelerator = _accelerator()
    if accelerator is not None:
        return int(accelerator.device_count())
    return torch.cuda.device_count()


def set_device(index: int) -> None:
    """Make `index` the current accelerator device of this process."""
    accelerator = _accelerator()
    if accelerator is not None:
        accelerator.set_device(index)
    else:
        torch.cuda.set_device(index)


def synchronize() -> None:
    """Wait for all queued work on the current device (no-op on CPU)."""
    if device_type() == "cpu":
        return
    accelerator = _accelerator()
    if accelerator is not None:
        accelerator.synchronize()
    else:
        torch.cuda.synchronize()
