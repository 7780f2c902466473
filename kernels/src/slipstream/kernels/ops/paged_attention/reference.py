"""Pure-torch paged attention: ragged queries attending causally over a block-table KV cache."""

from __future__ import annotations

import torch


def check_paged_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Raise ValueError naming the argument whose shape does not fit the others."""
    if query.dim() != 3:
        raise ValueError(
            f"paged_attention: query must be (tokens, heads, head_dim), got {tuple(query.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "paged_attention: key_cache and value_cache must both be (num_blocks, block_size, "
            f"kv_heads, head_dim), got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"paged_attention: query head_dim {query.shape[-1]} != cache head_dim "
            f"{key_cache.shape[-1]}"
        )
    if query.shape[1] % key_cache.shape[2] != 0:
        raise ValueError(
            f"paged_attention: {query.shape[1]} query heads are not a multiple of "
            f"{key_cache.shape[2]} KV heads"
        )
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"paged_attention: block_tables must be (num_seqs={num_seqs}, max_blocks), got "
            f"{tuple(block_tables.shape)}"
        )
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"paged_attention: query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
            f"got {tuple(query_start_loc.shape)}"
        )


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
    """Causal attention of a ragged batch of queries over keys/values held in fixed-size blocks.

    Args:
        query: ``(tokens, q_heads, head_dim)``: the new tokens of every sequence, back to back.
        key_cache, value_cache: ``(num_blocks, block_size, kv_heads, head_dim)``; the new
            tokens' keys/values must already be written into their slots.
        block_tables: ``(num_seqs, max_blocks)`` int: physical block of each logical block.
        seq_lens: ``(num_seqs,)`` int: each sequence's context length including its new tokens.
        query_start_loc: ``(num_seqs + 1,)`` int: where each sequence's queries start in
            ``query`` (cumulative query lengths, starting at 0).
        scale: multiplies ``q·k``; default ``head_dim ** -0.5``.
        max_query_len: unused here (the Triton backend sizes its grid with it).

    Query ``i`` of a sequence with ``q`` new tokens and context ``L`` sits at position
    ``L - q + i`` and sees keys ``0 .. L - q + i``: prefill chunks and single-token decodes are
    the same case. Grouped-query attention maps query head ``h`` to KV head
    ``h // (q_heads // kv_heads)``. Scores and softmax in fp32; output in ``query.dtype``.
    """
    del max_query_len
    check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    block_size, kv_heads, head_dim = key_cache.shape[1:]
    group = query.shape[1] // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    for seq, context in enumerate(lengths):
        begin, end = starts[seq], starts[seq + 1]
        if end == begin:
            continue
        blocks = block_tables[seq, : -(-context // block_size)].long()
        keys = key_cache[blocks].reshape(-1, kv_heads, head_dim)[:context].float()
        values = value_cache[blocks].reshape(-1, kv_heads, head_dim)[:context].float()
        keys = keys.repeat_interleave(group, dim=1)  # (context, q_heads, head_dim)
        values = values.repeat_interleave(group, dim=1)
        q = query[begin:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        positions = torch.arange(context - (end - begin), context, device=query.device)
        visible = torch.arange(context, device=query.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out
