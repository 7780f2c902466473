"""``paged_attention``: the reference against dense causal attention, the Triton backend against
the reference, on a ragged batch mixing decodes, prefill chunks and whole prompts, with GQA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import paged_attention as dispatched_paged_attention
from slipstream.kernels.ops.paged_attention.reference import paged_attention as reference

BLOCK_SIZE = 16


def _ragged_batch(
    dtype: torch.dtype,
    device: torch.device,
    *,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 24,
    seed: int = 0,
) -> dict:
    """(context, new tokens) per sequence: a decode, a prefill chunk, a whole prompt, a decode
    at a block boundary; keys and values live in shuffled physical blocks."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(37, 1), (40, 9), (21, 21), (33, 1)]
    num_blocks = sum(-(-context // BLOCK_SIZE) for context, _ in shapes) + 3
    key_cache = torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    value_cache = torch.zeros_like(key_cache)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, dense = [], []
    max_blocks = max(-(-context // BLOCK_SIZE) for context, _ in shapes)
    for context, _ in shapes:
        keys = torch.randn(context, kv_heads, head_dim, generator=generator)
        values = torch.randn(context, kv_heads, head_dim, generator=generator)
        blocks = [order.pop() for _ in range(-(-context // BLOCK_SIZE))]
        for index, block in enumerate(blocks):
            piece = slice(index * BLOCK_SIZE, min((index + 1) * BLOCK_SIZE, context))
            key_cache[block, : piece.stop - piece.start] = keys[piece]
            value_cache[block, : piece.stop - piece.start] = values[piece]
        tables.append(blocks + [0] * (max_blocks - len(blocks)))
        dense.append((keys, values))
    new_tokens = [new for _, new in shapes]
    query = torch.randn(sum(new_tokens), q_heads, head_dim, generator=generator)
    starts = torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "query": query.to(device, dtype),
        "key_cache": key_cache.to(device, dtype),
        "value_cache": value_cache.to(device, dtype),
        "block_tables": torch.tensor(tables, dtype=torch.int32, device=device),
        "seq_lens": torch.tensor([c for c, _ in shapes], dtype=torch.int32, device=device),
        "query_start_loc": starts.to(device),
        "dense": dense,
        "shapes": shapes,
    }


def test_reference_matches_dense_causal_attention() -> None:
    batch = _ragged_batch(torch.float32, torch.device("cpu"))
    dense, shapes = batch.pop("dense"), batch.pop("shapes")
    out = reference(**batch)
    starts = batch["query_start_loc"].tolist()
    for seq, ((context, new), (keys, values)) in enumerate(zip(shapes, dense)):
        q = batch["query"][starts[seq] : starts[seq + 1]].transpose(0, 1)  # (heads, new, dim)
        k = keys.repeat_interleave(2, dim=1).transpose(0, 1)
        v = values.repeat_interleave(2, dim=1).transpose(0, 1)
        mask = torch.ones(new, context, dtype=torch.bool).tril(diagonal=context - new)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[starts[seq] : starts[seq + 1]], expected)


def test_reference_rejects_mismatched_shapes() -> None:
    batch = _ragged_batch(torch.float32, torch.device("cpu"))
    batch.pop("dense"), batch.pop("shapes")
    batch["query_start_loc"] = batch["query_start_loc"][:-1]
    with pytest.raises(ValueError, match="query_start_loc must have num_seqs"):
        reference(**batch)


def test_dispatch_uses_reference_on_cpu() -> None:
    batch = _ragged_batch(torch.float32, torch.device("cpu"), seed=1)
    batch.pop("dense"), batch.pop("shapes")
    torch.testing.assert_close(dispatched_paged_attention(**batch), reference(**batch))


# Query-row tiles of 16 (fp32 cases: at most 21 x 2 rows per sequence) and of 64 (bf16: the
# 21-token prompt x 8 heads per KV head = 168 rows).
@pytest.mark.parametrize(
    ("dtype", "q_heads", "kv_heads"),
    [(torch.float32, 4, 2), (torch.bfloat16, 8, 1), (torch.float32, 3, 3)],
)
def test_triton_matches_reference(triton_device, dtype, q_heads, kv_heads) -> None:
    from slipstream.kernels.ops.paged_attention.triton import paged_attention

    batch = _ragged_batch(dtype, triton_device, q_heads=q_heads, kv_heads=kv_heads, seed=2)
    batch.pop("dense"), batch.pop("shapes")
    out = paged_attention(**batch, max_query_len=21)
    expected = reference(**batch)
    # fp32: summation order only; bf16: one rounding of the output plus the interpreter's
    # truncation of p to bf16 before p·V.
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    )
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)
