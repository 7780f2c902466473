"""Sequence-length curriculum: hand ``curriculum_seqlen`` to the model, or truncate the batch."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["accepts_curriculum_seqlen", "apply_seqlen_curriculum", "truncate_batch"]


@functools.lru_cache(maxsize=64)
def _forward_accepts(forward: Any) -> bool:
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return "curriculum_seqlen" in parameters


def accepts_curriculum_seqlen(module: nn.Module) -> bool:
    """Whether ``module.forward`` names a ``curriculum_seqlen`` parameter."""
    return _forward_accepts(type(module).forward)


def truncate_batch(value: Any, seqlen: int, full: int | None = None) -> Any:
    """Cut the sequence dimension of every tensor in ``value`` (nested lists/tuples/dicts).

    The sequence length is dim 1 of the first tensor with two or more dims; every tensor
    whose dim 1 has that length is cut to ``seqlen`` along it, and 4-d tensors (attention
    masks ``(batch, heads, query, key)``) are also cut along their last two dims where those
    have that length. Other tensors pass unchanged.
    """
    if full is None:
        full = _sequence_length(value)
        if full is None or full <= seqlen:
            return value
    if isinstance(value, torch.Tensor):
        out = value
        if out.dim() >= 2 and out.shape[1] == full:
            out = out[:, :seqlen]
        if out.dim() == 4:
            if out.shape[2] == full:
                out = out[:, :, :seqlen]
            if out.shape[3] == full:
                out = out[..., :seqlen]
        return out
    if isinstance(value, dict):
        return {k: truncate_batch(v, seqlen, full) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [truncate_batch(v, seqlen, full) for v in value]
        return type(value)(items) if isinstance(value, tuple) else items
    return value


def _sequence_length(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[1]) if value.dim() >= 2 else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _sequence_length(item)
            if found is not None:
                return found
    return None


def apply_seqlen_curriculum(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seqlen: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the model receives under a seqlen curriculum of ``seqlen`` tokens.

    A model whose forward takes ``curriculum_seqlen`` gets it as a keyword (DeepSpeed's
    contract: the model cuts its own inputs); any other model gets the batch truncated by
    :func:`truncate_batch`.
    """
    if accepts_curriculum_seqlen(module):
        return args, {**kwargs, "curriculum_seqlen": seqlen}
    truncated = truncate_batch((args, kwargs), seqlen)
    return truncated[0], truncated[1]
