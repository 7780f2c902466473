"""The ``argmax`` op: each row's first maximum, in one launch on a GPU (greedy decoding)."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "argmax"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.argmax.reference:argmax",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.argmax.triton:argmax")

__all__ = ["OP_NAME", "argmax"]


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's index of its maximum, ``int64`` ``(rows,)``, equal to
    ``scores.argmax(dim=-1)`` (first index on ties, NaN counts as the largest) with the best
    backend for ``scores`` ``(rows, columns)``.

    >>> argmax(torch.tensor([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]])).tolist()
    [1, 0]
    """
    fn = get_op(OP_NAME, scores.device.type, scores.dtype)
    return fn(scores)  # type: ignore[no-any-return]
