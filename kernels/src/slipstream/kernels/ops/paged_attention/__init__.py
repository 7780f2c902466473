"""The ``paged_attention`` op: ragged causal attention over a block-table (paged) KV cache."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "paged_attention"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.paged_attention.reference:paged_attention",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.paged_attention.triton:paged_attention")

__all__ = ["OP_NAME", "paged_attention"]


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Run the best available ``paged_attention`` backend for ``query``'s device and dtype.

    See :func:`slipstream.kernels.ops.paged_attention.reference.paged_attention` for the
    arguments. Two sequences, one decoding (1 new token after 5 cached) and one prefilling 3:

    >>> cache = torch.randn(4, 16, 2, 8)  # (num_blocks, block_size, kv_heads, head_dim)
    >>> out = paged_attention(
    ...     torch.randn(4, 4, 8), cache, cache.clone(),
    ...     block_tables=torch.tensor([[0], [2]], dtype=torch.int32),
    ...     seq_lens=torch.tensor([6, 3], dtype=torch.int32),
    ...     query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32))
    """
    fn = get_op(OP_NAME, query.device.type, query.dtype)
    return fn(  # type: ignore[no-any-return]
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        max_query_len=max_query_len,
    )
