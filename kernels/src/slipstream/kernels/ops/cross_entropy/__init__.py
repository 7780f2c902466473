"""The ``cross_entropy`` op: token-chunked cross-entropy for large vocabularies."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "cross_entropy"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.cross_entropy.reference:cross_entropy",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.cross_entropy.triton:cross_entropy")


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Run the best available ``cross_entropy`` backend for ``logits``' device and dtype.

    >>> loss = cross_entropy(torch.randn(4, 10, 32000), torch.randint(0, 32000, (4, 10)))
    """
    fn = get_op(OP_NAME, logits.device.type, logits.dtype)
    return fn(  # type: ignore[no-any-return]
        logits, target, ignore_index=ignore_index, chunk_size=chunk_size, reduction=reduction
    )
