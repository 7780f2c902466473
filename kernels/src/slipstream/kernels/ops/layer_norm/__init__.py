"""The ``layer_norm`` op: LayerNorm over the last dimension."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "layer_norm"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.layer_norm.reference:layer_norm",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.layer_norm.triton:layer_norm")


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Run the best available ``layer_norm`` backend for ``x``'s device and dtype."""
    fn = get_op(OP_NAME, x.device.type, x.dtype)
    return fn(x, weight, bias, eps)  # type: ignore[no-any-return]
