"""The ``rotary_embedding`` op: apply RoPE given cos/sin tables (NeoX or GPT-J layout)."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.ops.rotary_embedding.reference import rotary_cos_sin
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "rotary_embedding"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.rotary_embedding.reference:rotary_embedding",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.rotary_embedding.triton:rotary_embedding")

__all__ = ["OP_NAME", "rotary_cos_sin", "rotary_embedding"]


def rotary_embedding(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Run the best available ``rotary_embedding`` backend for ``x``'s device and dtype.

    >>> cos, sin = rotary_cos_sin(16, 8)
    >>> q = rotary_embedding(torch.randn(2, 4, 16, 8), cos, sin)  # (batch, heads, seq, dim)
    """
    fn = get_op(OP_NAME, x.device.type, x.dtype)
    return fn(x, cos, sin, interleaved=interleaved)  # type: ignore[no-any-return]
