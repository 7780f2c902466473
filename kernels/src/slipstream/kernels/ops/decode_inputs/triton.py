"""Triton decode-step prologue: one launch for what a decode step computes before its first block.

At batch-1 decode, the embedding gather (and learned position add), the rotary angles' cast,
multiply, cos and sin, the attention mask's comparisons, its grouped-query copy and the
additive mask's fill were about fifteen kernels of a few microseconds each. Here program
``(row, j)`` writes chunk ``j`` of the row's mask (every query row of the group), and program
``(row, 0)`` also gathers the row's embedding, the rotary cos/sin from tables the caller built
with torch (so their bits are torch's) and, with ``MARK``, sets ``key_valid[row, slot]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.decode_inputs.reference import check_shapes
from slipstream.kernels.ops.rms_norm.triton import (
    MAX_FUSED_COLS,
    rms_norm_forward_kernel,
    row_tile,
)
from slipstream.kernels.ops.rms_norm.triton import rms_norm as triton_rms_norm
from slipstream.kernels.triton_support import (
    AotSpec,
    arrival_counters,
    check_kernel_device,
    next_power_of_2,
)

# Mask slots one program writes (per query row of the group).
BLOCK_KEYS = 1024
# Hidden features the embedding gather moves per step of its loop.
BLOCK_HIDDEN = 2048
# Whether the first block's RMSNorm runs in this launch where it can (rms_norm_forward_kernel's
# code inlined, one row a program, rms_norm's warps); False: always the rms_norm op's launch.
FOLD_NORM = True


@triton.jit
def decode_inputs_kernel(
    ids_ptr,
    positions_ptr,
    valid_ptr,
    slots_ptr,
    next_slot_ptr,
    counter_ptr,
    embed_ptr,
    position_weight_ptr,
    cos_table_ptr,
    sin_table_ptr,
    x_ptr,
    cos_ptr,
    sin_ptr,
    mask_ptr,
    norm_weight_ptr,
    normed_ptr,
    rstd_ptr,
    keys,
    stride_valid,
    stride_embed,
    stride_position,
    window,
    position_offset,
    batch,
    n_cols,
    eps,
    HIDDEN: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2; 0: no rotary
    GROUP: tl.constexpr,
    LEARNED: tl.constexpr,
    BF16: tl.constexpr,
    WINDOW: tl.constexpr,
    MARK: tl.constexpr,
    ADVANCE: tl.constexpr,
    SINGLE: tl.constexpr,
    NORM: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program ``(b, j)``: mask chunk ``j`` of row ``b``; ``j == 0`` also the row's embedding,
    rotary cos/sin and (``MARK``) its key-valid flag at the query's slot. ``ADVANCE``: the slot
    is read from ``next_slot`` and written to ``slots``; each row's program ``j == 0`` adds one
    to its position once it has read it, and the last program to arrive (an arrival counter,
    left at 0; ``SINGLE``, the grid's only program: that one) adds one to ``next_slot``, after
    every program has read it. ``NORM``: program
    ``(b, 0)`` then runs ``rms_norm_forward_kernel``'s own code (inlined, one row a program, the
    launch's warps as rms_norm's launch has them: the same reduction, the same bits) on the
    row it has just written."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    if ADVANCE:
        slot = tl.load(next_slot_ptr)
    else:
        slot = tl.load(slots_ptr)
    k = j * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = k < keys
    valid = tl.load(valid_ptr + b.to(tl.int64) * stride_valid + k, mask=inside, other=0)
    allowed = (k <= slot) & (valid != 0)
    if WINDOW:
        allowed = allowed & (slot - k < window)
    allowed = allowed | (k == slot)
    zero = tl.zeros([BLOCK_K], dtype=tl.float32)
    value = tl.where(allowed, zero, zero - float("inf")).to(mask_ptr.dtype.element_ty)
    row = mask_ptr + b.to(tl.int64) * GROUP * keys
    for g in tl.static_range(GROUP):
        tl.store(row + g * keys + k, value, mask=inside)
    if j == 0:
        token = tl.load(ids_ptr + b).to(tl.int64)
        position = tl.load(positions_ptr + b).to(tl.int64)
        if ADVANCE:
            tl.store(positions_ptr + b, position + 1)
            if b == 0:
                tl.store(slots_ptr, slot)
        if MARK:
            tl.store(valid_ptr + b.to(tl.int64) * stride_valid + slot, 1)
        out = x_ptr + b.to(tl.int64) * HIDDEN
        for start in tl.static_range(0, HIDDEN, BLOCK_H):
            h = start + tl.arange(0, BLOCK_H)
            keep = h < HIDDEN
            x = tl.load(embed_ptr + token * stride_embed + h, mask=keep, other=0.0)
            if LEARNED:
                at = position + position_offset
                p = tl.load(position_weight_ptr + at * stride_position + h, mask=keep, other=0.0)
                total = x.to(tl.float32) + p.to(tl.float32)
                if BF16:  # round to nearest even by hand (the interpreter's cast truncates)
                    bits = total.to(tl.uint32, bitcast=True)
                    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                    x = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
                else:
                    x = total.to(x_ptr.dtype.element_ty)
            tl.store(out + h, x, mask=keep)
        if HALF > 0:
            r = tl.arange(0, BLOCK_R)
            use = r < HALF
            c = tl.load(cos_table_ptr + position * HALF + r, mask=use, other=0.0)
            s = tl.load(sin_table_ptr + position * HALF + r, mask=use, other=0.0)
            tl.store(cos_ptr + b * HALF + r, c, mask=use)
            tl.store(sin_ptr + b * HALF + r, s, mask=use)
        if NORM:
            tl.debug_barrier()  # the row's stores above are visible to every thread
            rms_norm_forward_kernel(
                x_ptr,
                norm_weight_ptr,
                normed_ptr,
                rstd_ptr,
                n_cols,
                n_cols,
                batch,
                n_cols,
                eps,
                HAS_WEIGHT=True,
                ROWS=1,
                BLOCK=NORM_BLOCK,
            )
    if ADVANCE:
        tl.debug_barrier()  # every thread of this program has read next_slot (release below)
        if SINGLE:  # the only program (batch 1, one mask chunk): no other reader to wait for
            tl.store(next_slot_ptr, slot + 1)
        else:
            arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
            if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
                tl.store(next_slot_ptr, slot + 1)
                tl.atomic_xchg(counter_ptr, 0)


def decode_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    slots: torch.Tensor,
    embed_weight: torch.Tensor,
    position_weight: torch.Tensor | None,
    position_offset: int,
    cos_table: torch.Tensor | None,
    sin_table: torch.Tensor | None,
    sliding_window: int | None,
    group: int,
    mark_valid: bool = False,
    next_slot: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None
]:
    """See :func:`slipstream.kernels.ops.decode_inputs.reference.decode_inputs`.

    The tables must cover every position given (positions are not range-checked on the GPU).
    The RMSNorm joins the launch where ``rms_norm``'s launch holds one row a program
    (batch 1, or rows of 2048 features or more); otherwise it is the ``rms_norm`` op's launch.
    """
    check_kernel_device(
        "decode_inputs",
        input_ids,
        positions,
        key_valid,
        slots,
        next_slot,
        embed_weight,
        position_weight,
        cos_table,
        sin_table,
    )
    check_shapes(
        input_ids,
        positions,
        key_valid,
        slots,
        embed_weight,
        position_weight,
        cos_table,
        sin_table,
        group,
        next_slot,
        norm_weight,
    )
    if key_valid.stride(1) != 1:
        raise ValueError("decode_inputs (triton): key_valid needs a unit stride along the keys")
    batch, keys = key_valid.shape
    hidden = embed_weight.shape[1]
    device, dtype = embed_weight.device, embed_weight.dtype
    if embed_weight.stride(1) != 1:
        embed_weight = embed_weight.contiguous()
    if position_weight is not None and position_weight.stride(1) != 1:
        position_weight = position_weight.contiguous()
    x = torch.empty(batch, 1, hidden, device=device, dtype=dtype)
    mask = torch.empty(batch, 1, group, keys, device=device, dtype=dtype)
    half = 0 if cos_table is None else cos_table.shape[1]
    cos = sin = None
    if cos_table is not None and sin_table is not None:
        cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
        cos = torch.empty(batch, 1, 1, half, device=device, dtype=torch.float32)
        sin = torch.empty_like(cos)
    rows, norm_block, norm_warps = row_tile(batch, hidden)
    fold = FOLD_NORM and norm_weight is not None and rows == 1 and hidden <= MAX_FUSED_COLS
    normed = torch.empty_like(x) if fold else None
    rstd = torch.empty(batch, device=device, dtype=torch.float32) if fold else None
    if fold and norm_weight is not None and not norm_weight.is_contiguous():
        norm_weight = norm_weight.contiguous()
    block_k = max(16, min(BLOCK_KEYS, next_power_of_2(keys)))
    grid = (batch, triton.cdiv(keys, block_k))
    decode_inputs_kernel[grid](
        input_ids.reshape(batch).contiguous(),  # no copy for a (batch, 1) tensor of its own
        positions.reshape(batch)
        if next_slot is not None
        else positions.reshape(batch).contiguous(),
        key_valid.view(torch.uint8),
        slots,
        next_slot if next_slot is not None else slots,
        arrival_counters("decode_inputs", device, 1) if next_slot is not None else slots,
        embed_weight,
        position_weight if position_weight is not None else embed_weight,
        cos_table if cos_table is not None else mask,
        sin_table if sin_table is not None else mask,
        x,
        cos if cos is not None else mask,
        sin if sin is not None else mask,
        mask,
        norm_weight if fold else mask,
        normed if normed is not None else mask,
        rstd if rstd is not None else mask,
        keys,
        key_valid.stride(0),
        embed_weight.stride(0),
        position_weight.stride(0) if position_weight is not None else 0,
        sliding_window or 0,
        position_offset,
        batch,
        hidden,
        float(norm_eps),
        HIDDEN=hidden,
        HALF=half,
        GROUP=group,
        LEARNED=position_weight is not None,
        BF16=dtype == torch.bfloat16,
        WINDOW=sliding_window is not None,
        MARK=mark_valid,
        ADVANCE=next_slot is not None,
        SINGLE=grid == (1, 1),
        NORM=fold,
        NORM_BLOCK=norm_block,
        BLOCK_H=max(16, min(BLOCK_HIDDEN, next_power_of_2(hidden))),
        BLOCK_R=max(16, next_power_of_2(half)),
        BLOCK_K=block_k,
        # rms_norm's warps where its code runs here: the same layout, the same reduction order
        num_warps=norm_warps if fold else 4,
    )
    if norm_weight is not None and normed is None:
        normed = triton_rms_norm(x, norm_weight, norm_eps)
    return x, cos, sin, mask, normed


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    shapes = (  # (name, hidden, half, group, learned, window): Llama-3 8B, Mistral, OPT
        ("llama8b", 4096, 64, 4, False, False),
        ("mistral", 4096, 64, 4, False, True),
        ("opt", 768, 0, 1, True, False),
    )
    for dtype in ("bf16", "fp16"):
        for name, hidden, half, group, learned, window in shapes:
            specs.append(
                AotSpec(
                    f"decode_inputs[{dtype},{name}]",
                    decode_inputs_kernel,
                    {
                        "ids_ptr": "*i64",
                        "positions_ptr": "*i64",
                        "valid_ptr": "*u8",
                        "slots_ptr": "*i64",
                        "next_slot_ptr": "*i64",
                        "counter_ptr": "*i32",
                        "embed_ptr": f"*{dtype}",
                        "position_weight_ptr": f"*{dtype}",
                        "cos_table_ptr": "*fp32",
                        "sin_table_ptr": "*fp32",
                        "x_ptr": f"*{dtype}",
                        "cos_ptr": "*fp32",
                        "sin_ptr": "*fp32",
                        "mask_ptr": f"*{dtype}",
                        "norm_weight_ptr": f"*{dtype}",
                        "normed_ptr": f"*{dtype}",
                        "rstd_ptr": "*fp32",
                        "keys": "i32",
                        "stride_valid": "i32",
                        "stride_embed": "i32",
                        "stride_position": "i32",
                        "window": "i32",
                        "position_offset": "i32",
                        "batch": "i32",
                        "n_cols": "i32",
                        "eps": "fp32",
                        "HIDDEN": "constexpr",
                        "HALF": "constexpr",
                        "GROUP": "constexpr",
                        "LEARNED": "constexpr",
                        "BF16": "constexpr",
                        "WINDOW": "constexpr",
                        "MARK": "constexpr",
                        "ADVANCE": "constexpr",
                        "SINGLE": "constexpr",
                        "NORM": "constexpr",
                        "NORM_BLOCK": "constexpr",
                        "BLOCK_H": "constexpr",
                        "BLOCK_R": "constexpr",
                        "BLOCK_K": "constexpr",
                    },
                    {
                        "HIDDEN": hidden,
                        "HALF": half,
                        "GROUP": group,
                        "LEARNED": learned,
                        "BF16": dtype == "bf16",
                        "WINDOW": window,
                        "MARK": True,
                        "ADVANCE": True,
                        "SINGLE": learned,
                        "NORM": not learned,
                        "NORM_BLOCK": next_power_of_2(hidden),
                        "BLOCK_H": min(BLOCK_HIDDEN, next_power_of_2(hidden)),
                        "BLOCK_R": 64,
                        "BLOCK_K": BLOCK_KEYS,
                    },
                )
            )
    return specs
