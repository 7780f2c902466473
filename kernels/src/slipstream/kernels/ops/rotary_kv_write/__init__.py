"""The ``rotary_kv_write`` op: split a fused QKV, rotate Q and K, write K and V into a KV cache."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "rotary_kv_write"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.rotary_kv_write.reference:rotary_kv_write",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.rotary_kv_write.triton:rotary_kv_write")

__all__ = ["OP_NAME", "rotary_kv_write"]


def rotary_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    """Run the best ``rotary_kv_write`` backend; returns queries ``(batch, heads, tokens, dim)``
    (``pdl``: the GPU kernel launches with programmatic dependent launch, sm_90+).

    See :func:`slipstream.kernels.ops.rotary_kv_write.reference.rotary_kv_write`.

    >>> qkv = torch.randn(1, 3, (4 + 2 * 2) * 8)
    >>> keys, values = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)
    >>> cos, sin = torch.ones(1, 3, 4), torch.zeros(1, 3, 4)
    >>> q = rotary_kv_write(qkv, cos, sin, keys, values, torch.arange(3), 4, 2)
    """
    fn = get_op(OP_NAME, qkv.device.type, qkv.dtype)
    return fn(  # type: ignore[no-any-return]
        qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads, pdl=pdl
    )
