"""The ``moe_gemv`` op: rows multiplied by the weights of their own experts (MoE decode)."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "moe_gemv"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.moe_gemv.reference:moe_gemv",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.moe_gemv.triton:moe_gemv")

__all__ = ["OP_NAME", "moe_gemv"]


def moe_gemv(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[r] = weights[experts[r]] @ x[r]`` with the best backend (inference only).

    >>> out = moe_gemv(torch.randn(3, 8), torch.tensor([0, 2, 0]), torch.randn(4, 5, 8))
    """
    fn = get_op(OP_NAME, x.device.type, x.dtype)
    return fn(x, experts, weights)  # type: ignore[no-any-return]
