"""The ``gated_activation`` op: ``act(gate) * up`` over a fused gate/up projection (SwiGLU)."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.ops.gated_activation.reference import ACTIVATIONS
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "gated_activation"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.gated_activation.reference:gated_activation",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.gated_activation.triton:gated_activation")

__all__ = ["ACTIVATIONS", "OP_NAME", "gated_activation"]


def gated_activation(x: torch.Tensor, name: str = "silu") -> torch.Tensor:
    """``act(x[..., :n]) * x[..., n:]`` with the best backend; ``name`` from ``ACTIVATIONS``.

    >>> y = gated_activation(torch.randn(2, 16))  # (2, 8)
    """
    fn = get_op(OP_NAME, x.device.type, x.dtype)
    return fn(x, name)  # type: ignore[no-any-return]
