"""Triton paged attention: one program per (sequence, KV head, tile of query rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.paged_attention.reference import check_paged_inputs
from slipstream.kernels.triton_support import (
    AotSpec,
    check_kernel_device,
    interpreting,
    next_power_of_2,
)

# Query rows per program, (query token, head of the GQA group) pairs: 16 (the least tl.dot
# takes) when every sequence has few rows, as in decode; 64 when some prompt chunk fills
# them, so a prefill tile reuses each loaded key block for four times more queries.
BLOCK_M_DECODE, BLOCK_M_PREFILL = 16, 64


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    q_stride_t,
    q_stride_h,
    k_stride_b,
    k_stride_t,
    k_stride_h,
    v_stride_b,
    v_stride_t,
    v_stride_h,
    o_stride_t,
    o_stride_h,
    bt_stride_s,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Flash-style online softmax over the sequence's KV blocks, read through its block table.

    The rows of one tile are (query token, query head) pairs of one KV head's group, so the
    heads sharing a KV head (GQA) read each key/value block once; a decode step of a model
    with 4 query heads per KV head fills 4 rows of the tile instead of 1.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this step's queries

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_query = rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = row_query < q_len
    row_pos = context + row_query
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim

    q_rows = (q_start + row_query).to(tl.int64) * q_stride_t + row_head.to(tl.int64) * q_stride_h
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys up to the last query of this tile are needed, never past the context.
    last_query = tl.minimum((tile + 1) * BLOCK_M // GROUP + 1, q_len)
    num_blocks = tl.cdiv(tl.minimum(context + last_query, seq_len), BLOCK_SIZE)
    offs_t = tl.arange(0, BLOCK_SIZE)
    for block in range(0, num_blocks):
        physical = tl.load(block_tables_ptr + seq * bt_stride_s + block).to(tl.int64)
        key_pos = block * BLOCK_SIZE + offs_t
        key_valid = key_pos < seq_len
        k = tl.load(
            k_cache_ptr
            + physical * k_stride_b
            + offs_t[None, :] * k_stride_t
            + kv_head * k_stride_h
            + offs_d[:, None],
            mask=d_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            scores = tl.dot(q, k, input_precision="ieee") * scale
        else:
            scores = tl.dot(q, k) * scale
        keep = (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr
            + physical * v_stride_b
            + offs_t[:, None] * v_stride_t
            + kv_head * v_stride_h
            + offs_d[None, :],
            mask=key_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + row_query).to(tl.int64) * o_stride_t + row_head.to(tl.int64) * o_stride_h
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
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
    """Triton backend of ``paged_attention`` (same contract as the reference).

    ``max_query_len`` sizes the grid; pass it (the scheduler knows it) to avoid reading
    ``query_start_loc`` back from the GPU, a device-to-host sync.
    """
    check_paged_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    check_kernel_device("paged_attention", query, key_cache, value_cache, block_tables)
    _, block_size, kv_heads, head_dim = key_cache.shape
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"paged_attention (triton): block_size {block_size} must be a power of two >= 16; "
            "choose such a KV-cache block size"
        )
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"paged_attention (triton): {name}'s last dimension must be dense")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())  # sync
    group = query.shape[1] // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    rows = max(max_query_len, 1) * group
    block_m = BLOCK_M_PREFILL if rows >= BLOCK_M_PREFILL else BLOCK_M_DECODE
    grid = (num_seqs, kv_heads, triton.cdiv(rows, block_m))
    paged_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale),
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        head_dim,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        IEEE=query.dtype == torch.float32,
        # Triton's CPU interpreter computes bf16 tl.dot wrongly (3.9): multiply in fp32 there.
        UPCAST=interpreting() and query.dtype == torch.bfloat16,
    )
    return out


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    variants = [(dtype, group, BLOCK_M_DECODE) for dtype in ("bf16", "fp16") for group in (1, 4, 8)]
    variants.append(("bf16", 4, BLOCK_M_PREFILL))
    for dtype, group, block_m in variants:
        signature = {
            "q_ptr": f"*{dtype}",
            "k_cache_ptr": f"*{dtype}",
            "v_cache_ptr": f"*{dtype}",
            "out_ptr": f"*{dtype}",
            "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "query_start_ptr": "*i32",
            "scale": "fp32",
            **{
                name: "i64"
                for name in (
                    "q_stride_t",
                    "q_stride_h",
                    "k_stride_b",
                    "k_stride_t",
                    "k_stride_h",
                    "v_stride_b",
                    "v_stride_t",
                    "v_stride_h",
                    "o_stride_t",
                    "o_stride_h",
                    "bt_stride_s",
                )
            },
            "head_dim": "i32",
            "GROUP": "constexpr",
            "BLOCK_M": "constexpr",
            "BLOCK_SIZE": "constexpr",
            "BLOCK_D": "constexpr",
            "IEEE": "constexpr",
            "UPCAST": "constexpr",
        }
        constexprs = {
            "GROUP": group,
            "BLOCK_M": block_m,
            "BLOCK_SIZE": 16,
            "BLOCK_D": 128,
            "IEEE": False,
            "UPCAST": False,
        }
        specs.append(
            AotSpec(
                f"paged_attention[{dtype},group={group},block_m={block_m}]",
                paged_attention_kernel,
                signature,
                constexprs,
            )
        )
    return specs
