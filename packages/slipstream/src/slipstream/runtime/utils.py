"""DeepSpeed's ``deepspeed.runtime.utils`` helpers that training scripts call.

>>> from slipstream.runtime.utils import set_random_seed
>>> set_random_seed(1234)
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import torch

from slipstream.kernels import get_accelerator

__all__ = ["empty_cache", "move_to_device", "see_memory_usage", "set_random_seed"]

logger = logging.getLogger(__name__)


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (when NumPy is installed) and torch."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # NumPy is optional
        pass
    else:
        numpy.random.seed(seed % (2**32))  # NumPy takes 32-bit seeds only
    torch.manual_seed(seed % (2**63))


def move_to_device(
    item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """``item`` with every tensor (inside lists, tuples and dicts) moved to ``device``; with
    ``criterion_func``, only the items it accepts."""
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, torch.Tensor) and (criterion_func is None or criterion_func(item)):
        return item.to(device)
    return item


def empty_cache() -> None:
    """Return cached device memory to the driver."""
    get_accelerator().empty_cache()


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log device memory (allocated, peak, reserved) with ``message``; only when ``force``."""
    if not force:
        return
    accelerator = get_accelerator()
    gib = 2**30
    logger.info(
        "%s | allocated %.2f GiB, peak %.2f GiB, reserved %.2f GiB",
        message,
        accelerator.memory_allocated() / gib,
        accelerator.max_memory_allocated() / gib,
        accelerator.memory_reserved() / gib,
    )
