"""Sequence-length curriculum: hand ``curriculum_seqlen`` to the model, truncate or reshape the batch."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
from torch import nn

__all__ = [
    "accepts_curriculum_seqlen",
    "apply_seqlen_curriculum",
    "reshape_batch",
    "reshaped_rows",
    "seqlen_post_process",
    "truncate_batch",
]


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


def reshaped_rows(batch: int, length: int, width: int) -> int:
    """Rows :func:`reshape_batch` returns for a ``(batch, length)`` tensor cut into rows of
    ``width`` tokens (``length`` itself when ``width >= length``: nothing is cut)."""
    if width >= length:
        return batch
    pieces = batch * (length // width) + batch  # every full piece, then one tail per row
    rows = min(math.ceil(batch * length / width), pieces)
    if rows > 1 and rows % 2:
        rows -= 1
    return rows


def reshape_batch(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """DeepSpeed's ``seqlen_reshape`` curriculum: cut every row of ``tokens`` into rows of
    ``width`` tokens, so a short-context step still holds about as many tokens as a full one.

    ``tokens`` is ``(batch, length)``. The result stacks, in order, the full pieces of
    ``width`` tokens of row 0, row 1, ... (a row's remainder shorter than ``width`` is left
    out), then the last ``width`` tokens of every row, and keeps the first
    ``ceil(batch * length / width)`` of those rows, one fewer when that count is odd and above
    one: Megatron-DeepSpeed's GPT ``data_post_process`` for the ``seqlen_reshape`` metric, which
    applies it to the ``(batch, seq + 1)`` text with ``width = curriculum_seqlen + 1`` (each row
    then gives ``curriculum_seqlen`` inputs and their next-token labels). With
    ``width >= length`` the tensor is returned unchanged.
    """
    if tokens.dim() != 2:
        raise ValueError(
            f"reshape_batch() takes a (batch, length) tensor, got {tuple(tokens.shape)}"
        )
    if width < 1:
        raise ValueError(f"reshape_batch(): width must be positive, got {width}")
    batch, length = tokens.shape
    if width >= length:
        return tokens
    cut = length // width * width
    stacked = torch.cat((tokens[:, :cut].reshape(-1, width), tokens[:, -width:]), dim=0)
    return stacked[: reshaped_rows(batch, length, width)].contiguous()


def seqlen_post_process(
    batch: Any, progress: dict[str, Any], key: str = "text", seq_length: int | None = None
) -> Any:
    """A ``set_data_post_process_func`` hook for the ``seqlen_truncate`` / ``seqlen_reshape``
    curriculum metrics of ``data_sampling``, as Megatron-DeepSpeed's GPT training applies them.

    ``batch[key]`` holds ``(batch, seq + 1)`` token windows (inputs and next-token labels).
    While the sampler's current difficulty ``d`` of either metric is below ``seq`` (default:
    ``batch[key].shape[1] - 1``), ``seqlen_truncate`` keeps the first ``d + 1`` columns and
    ``seqlen_reshape`` cuts the rows with :func:`reshape_batch` to width ``d + 1``. Other
    batches pass unchanged.
    """
    difficulties = progress.get("current_difficulties", {})
    text = batch[key]
    seq = text.shape[1] - 1 if seq_length is None else seq_length
    if "seqlen_truncate" in difficulties:
        current = int(difficulties["seqlen_truncate"])
        if current < seq:
            batch = {**batch, key: text[:, : current + 1].contiguous()}
    elif "seqlen_reshape" in difficulties:
        current = int(difficulties["seqlen_reshape"])
        if current < seq:
            batch = {**batch, key: reshape_batch(text, current + 1)}
    return batch
