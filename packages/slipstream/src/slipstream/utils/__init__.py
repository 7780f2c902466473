"""DeepSpeed's ``deepspeed.utils``: the logger, ``RepeatingLoader`` and the ``safe_get_*`` helpers.

>>> from slipstream.utils import RepeatingLoader, logger, safe_get_full_fp32_param
>>> loader = RepeatingLoader([1, 2])
>>> [next(loader) for _ in range(3)]
[1, 2, 1]
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from slipstream.utils import zero_to_fp32
from slipstream.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
)

__all__ = [
    "RepeatingLoader",
    "instrument_w_nvtx",
    "log_dist",
    "log_dist_once",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "set_log_level_from_string",
    "zero_to_fp32",
]

#: The library's logger (DeepSpeed's ``deepspeed.utils.logger``); rank 0 logs at INFO once
#: ``slipstream.initialize`` has set logging up.
logger = logging.getLogger("slipstream")

_T = TypeVar("_T")

# DeepSpeed names this package does not provide, each with what to use instead.
_ABSENT = {
    "OnDevice": "not provided; build a model too big for one device under slipstream.zero.Init "
    "(ZeRO-3), which shards each module as it is constructed",
    "groups": "process groups come from slipstream.comm (and slipstream.moe.groups for experts)",
    "set_z3_leaf_modules": "ZeRO-3 leaf modules are not implemented in slipstream-zero",
    "z3_leaf_module": "ZeRO-3 leaf modules are not implemented in slipstream-zero",
    "get_z3_leaf_modules": "ZeRO-3 leaf modules are not implemented in slipstream-zero",
    "safe_set_full_grad": "gradients are reduced into the masters at the boundary; scale the "
    "loss or edit engine.optimizer's parameters' .grad instead",
    "safe_set_local_grad": "see safe_set_full_grad",
    "safe_set_local_optimizer_state": "use safe_set_full_optimizer_state",
    "safe_update_full_grad_vectorized": "see safe_set_full_grad",
}


def __getattr__(name: str) -> Any:
    if name in _ABSENT:
        raise AttributeError(
            f"slipstream.utils.{name} (deepspeed.utils.{name}) is not available in Slipstream: "
            f"{_ABSENT[name]} (docs/deepspeed-compat.md)"
        )
    raise AttributeError(f"module 'slipstream.utils' has no attribute {name!r}")


class RepeatingLoader:
    """Iterate over ``loader`` for ever, restarting it each time it runs out.

    Args:
        loader: any iterable (a ``DataLoader``, a list, ...).
    """

    def __init__(self, loader: Iterable[_T]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given global ``ranks`` (``[-1]``: every rank), as DeepSpeed does.

    Without a process group every call logs; with one and ``ranks`` None, none does.
    """
    chosen = set(ranks or [])
    should_log = not dist.is_initialized()
    if chosen and not should_log:
        should_log = -1 in chosen or dist.get_rank() in chosen
    if should_log:
        rank = dist.get_rank() if dist.is_initialized() else -1
        logger.log(level, "[Rank %d] %s", rank, message)


@functools.lru_cache(None)
def log_dist_once(
    message: str, ranks: tuple[int, ...] | None = None, level: int = logging.INFO
) -> None:
    """:func:`log_dist`, once per distinct (message, ranks, level)."""
    log_dist(message, list(ranks) if ranks is not None else None, level)


def set_log_level_from_string(
    log_level_str: str, custom_logger: logging.Logger | None = None
) -> None:
    """Set the logger's level from a name such as ``"info"`` or ``"debug"``."""
    level = logging.getLevelName(log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(
            f"invalid log level {log_level_str!r}; use debug, info, warning, error or critical"
        )
    (custom_logger or logger).setLevel(level)


def instrument_w_nvtx(func: Callable[..., _T]) -> Callable[..., _T]:
    """Wrap ``func`` in an NVTX range named after it (a plain call without CUDA)."""

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> _T:
        if not torch.cuda.is_available():
            return func(*args, **kwargs)
        with torch.cuda.nvtx.range(func.__qualname__):
            return func(*args, **kwargs)

    return wrapped
