"""The ``rms_norm`` op: root-mean-square normalisation over the last dimension."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "rms_norm"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.rms_norm.reference:rms_norm",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.rms_norm.triton:rms_norm")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Run the best available ``rms_norm`` backend for ``x``'s device and dtype.

    >>> y = rms_norm(torch.randn(2, 8), torch.ones(8))
    """
    return get_op(OP_NAME, x.device.type, x.dtype)(x, weight, eps)  # type: ignore[no-any-return]
