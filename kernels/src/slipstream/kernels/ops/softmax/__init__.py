"""The ``softmax`` op: attention-score softmax with optional scale and causal/explicit masks."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.ops.softmax.reference import causal_keep_mask
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "softmax"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.softmax.reference:softmax",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.softmax.triton:softmax")

__all__ = ["OP_NAME", "causal_keep_mask", "softmax"]


def softmax(
    scores: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the best available ``softmax`` backend for ``scores``' device and dtype.

    >>> probs = softmax(torch.randn(2, 4, 8, 8), scale=0.125, causal=True)
    """
    fn = get_op(OP_NAME, scores.device.type, scores.dtype)
    return fn(scores, scale=scale, causal=causal, mask=mask)  # type: ignore[no-any-return]
