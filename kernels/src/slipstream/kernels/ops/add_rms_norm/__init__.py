"""The ``add_rms_norm`` op: a residual add and the RMSNorm of its result, in one pass."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "add_rms_norm"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.add_rms_norm.reference:add_rms_norm",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.add_rms_norm.triton:add_rms_norm")

__all__ = ["OP_NAME", "add_rms_norm"]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, rms_norm(x + residual))`` with the best backend (inference: no grad).

    >>> total, normed = add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8))
    """
    fn = get_op(OP_NAME, x.device.type, x.dtype)
    return fn(x, residual, weight, eps)  # type: ignore[no-any-return]
