"""The ``decode_attention`` op: a GQA group's query rows over a static KV cache (split-K at decode)."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "decode_attention"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.decode_attention.reference:decode_attention",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.decode_attention.triton:decode_attention")

__all__ = ["OP_NAME", "decode_attention"]


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    pdl: bool = False,
    trigger: bool | str = False,
    prefetch: bool = False,
    new_slots: torch.Tensor | None = None,
    weights: tuple[torch.Tensor, ...] = (),
    weights_when: str = "waited",
) -> torch.Tensor:
    """``softmax(query @ key^T * scale + mask) @ value`` per KV head with the best backend:
    ``query`` ``(batch, kv_heads, rows, head_dim)``, ``key``/``value`` ``(batch, kv_heads,
    slots, head_dim)``, ``mask`` additive, broadcasting to ``(batch, kv_heads, rows, slots)``.
    ``pdl``: the GPU kernel launches with programmatic dependent launch (sm_90+: it may start
    while the previous kernel finishes and waits for it before reading); ``trigger``: it lets
    the next kernel launch at once (a kernel launched with programmatic dependent launch then
    starts while attention runs; sm_90+, a no-op elsewhere; ``"issued"`` / ``"waited"``: once
    its early loads are issued / after its wait instead of at its start); ``prefetch`` (with ``pdl``): before
    it waits, it asks L2 for the cache's keys and values; ``new_slots`` (with ``pdl``: a 1-D device tensor,
    written before the previous kernel runs): the cache slots the previous kernel writes, the
    only ones it must read after waiting for that kernel (it loads the others' first chunk
    before); ``weights`` (up to two contiguous tensors, e.g. the next projection's): prefetched
    into L2 by its programs (sm_90), ``weights_when`` ``"early"`` (before the wait) or
    ``"waited"``. None of them changes the result.

    >>> out = decode_attention(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 8, 16),
    ...                        torch.randn(1, 2, 8, 16), torch.zeros(1, 1, 4, 8), 0.25)
    """
    fn = get_op(OP_NAME, query.device.type, query.dtype)
    return fn(  # type: ignore[no-any-return]
        query,
        key,
        value,
        mask,
        scale,
        pdl=pdl,
        trigger=trigger,
        prefetch=prefetch,
        new_slots=new_slots,
        weights=weights,
        weights_when=weights_when,
    )
