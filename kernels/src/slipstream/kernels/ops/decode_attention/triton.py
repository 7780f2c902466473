"""Triton split-K decode attention (flash-decoding) over a static KV cache.

At decode each KV head has a handful of query rows (the query heads of its GQA group) and a
cache of ``slots`` keys; one program per head would read its keys serially on a few SMs. The
first kernel splits the slots into ``block_s`` chunks, one program per (chunk, batch x KV head):
it scores the chunk's keys against all the group's rows with one tensor-core dot (rows padded to
16), adds the additive mask, and writes the chunk's row maxima, exp-sums and unnormalised
``p @ V`` in fp32. The second kernel, one program per (batch x KV head), merges the chunks with
the online-softmax rescaling and writes the output in the query's dtype. A chunk whose keys are
all masked contributes nothing (its maximum is ``-inf``, its weight 0).

For short caches a third form, one program per (batch x KV head) walking the chunks with the
online softmax (``decode_attention_loop_kernel``), stores the output itself: no partials and no
merge, whose stores, arrival counter and loads cost more latency than a few serial chunks whose
loads are pipelined. Where the GPU has SMs to spare it runs two programs per (batch x KV head),
each scoring all keys and weighting half of the value features (``LOOP_D_SPLIT``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.decode_attention.reference import check_shapes
from slipstream.kernels.ops.decode_attention.reference import decode_attention as reference
from slipstream.kernels.ops.decode_gemv.triton import _l2_prefetch_rows
from slipstream.kernels.triton_support import (
    AotSpec,
    arrival_counters,
    check_kernel_device,
    next_power_of_2,
    pdl_supported,
)

__all__ = ["LOOP_MAX_SLOTS", "decode_attention", "default_block_s"]

MAX_ROWS = 64  # query rows per KV head (GQA group x tokens) the kernel takes
MERGE_IN_SPLIT = True  # one launch: the last chunk program of each head merges the chunks

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: never traced with TRIGGER=True or GDC=True

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        """Placeholder (this Triton has no grid dependency control)."""

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        """Placeholder (this Triton has no grid dependency control)."""


@triton.jit
def _chunk_scores(
    q, k, mask_ptr, b, h, r, s, r_ok, s_ok, mask_sb, mask_sh, mask_sr, mask_ss, scale,
    IEEE: tl.constexpr,
):  # fmt: skip
    """``q @ k^T * scale`` plus the additive mask of rows ``r`` and slots ``s`` (fp32)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    bias = tl.load(
        mask_ptr + b * mask_sb + h * mask_sh + r[:, None] * mask_sr + s[None, :] * mask_ss,
        mask=r_ok[:, None] & s_ok[None, :],
        other=float("-inf"),
    )
    return scores + bias.to(tl.float32)


@triton.jit
def _weighted_values(p, v, IEEE: tl.constexpr):
    """``p @ v`` in ``v``'s dtype with fp32 accumulation."""
    if IEEE:
        return tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return tl.dot(p.to(v.dtype), v)


@triton.jit
def decode_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    ROWS,
    SLOTS,
    KV_HEADS,
    SPLITS,
    scale,
    q_sb,
    q_sh,
    q_sr,
    k_sb,
    k_sh,
    k_ss,
    v_sb,
    v_sh,
    v_ss,
    mask_sb,
    mask_sh,
    mask_sr,
    mask_ss,
    out_ptr,
    counter_ptr,
    o_sb,
    o_sh,
    o_sr,
    ROWS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    MERGE: tl.constexpr,
    TRIGGER: tl.constexpr = 0,  # TRIGGER_POINTS: 1 at the start, 2 or 3 after the wait
    GDC: tl.constexpr = False,
):
    """One chunk of ``BLOCK_S`` slots of one (batch, KV head): partial softmax statistics.
    ``MERGE``: the last chunk program of each (batch, KV head) to finish (an arrival counter,
    reset to 0 by that program for the next call) merges them, so one launch does it all.
    ``GDC`` (launched with programmatic dependent launch): every program waits for the previous
    kernel (which wrote the queries and the cache) before reading. ``TRIGGER``: the next kernel
    may be scheduled at once (a kernel launched with programmatic dependent launch, the output
    projection, prefetches its weight while attention runs; 2 or 3: after the wait); else
    only when attention ends."""
    if TRIGGER == 1:
        gdc_launch_dependents()
    if GDC:
        gdc_wait()
    if TRIGGER >= 2:
        gdc_launch_dependents()
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    r = tl.arange(0, ROWS_PAD)
    d = tl.arange(0, HEAD_DIM)
    s = split * BLOCK_S + tl.arange(0, BLOCK_S)
    r_ok = r < ROWS
    s_ok = s < SLOTS
    q = tl.load(
        q_ptr + b * q_sb + h * q_sh + r[:, None] * q_sr + d[None, :], mask=r_ok[:, None], other=0.0
    )
    k = tl.load(
        k_ptr + b * k_sb + h * k_sh + s[:, None] * k_ss + d[None, :], mask=s_ok[:, None], other=0.0
    )
    scores = _chunk_scores(
        q, k, mask_ptr, b, h, r, s, r_ok, s_ok, mask_sb, mask_sh, mask_sr, mask_ss, scale, IEEE
    )
    m = tl.max(scores, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(scores - m_safe[:, None])
    l_sum = tl.sum(p, axis=1)
    v = tl.load(
        v_ptr + b * v_sb + h * v_sh + s[:, None] * v_ss + d[None, :], mask=s_ok[:, None], other=0.0
    )
    acc = _weighted_values(p, v, IEEE)
    row = (bh * SPLITS + split) * ROWS_PAD + r
    tl.store(m_ptr + row, m)
    tl.store(l_ptr + row, l_sum)
    tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc)
    if MERGE:
        tl.debug_barrier()  # every thread's partial stores precede the arrival (release)
        arrived = tl.atomic_add(counter_ptr + bh, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            _merge_chunks(
                m_ptr,
                l_ptr,
                acc_ptr,
                out_ptr,
                bh,
                ROWS,
                KV_HEADS,
                SPLITS,
                o_sb,
                o_sh,
                o_sr,
                ROWS_PAD,
                HEAD_DIM,
            )
            tl.atomic_xchg(counter_ptr + bh, 0)


@triton.jit
def _merge_chunks(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    bh,
    ROWS,
    KV_HEADS,
    SPLITS,
    o_sb,
    o_sh,
    o_sr,
    ROWS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Merge the chunks of (batch x KV head) ``bh`` with online-softmax rescaling and store
    the output rows (the partials are read from L2: ``.cg``, never a stale L1 line)."""
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    r = tl.arange(0, ROWS_PAD)
    d = tl.arange(0, HEAD_DIM)
    best = tl.full((ROWS_PAD,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((ROWS_PAD,), dtype=tl.float32)
    out = tl.zeros((ROWS_PAD, HEAD_DIM), dtype=tl.float32)
    for split in range(0, SPLITS):
        row = (bh * SPLITS + split) * ROWS_PAD + r
        m = tl.load(m_ptr + row, cache_modifier=".cg")
        new = tl.maximum(best, m)
        new_safe = tl.where(new == float("-inf"), 0.0, new)
        alpha = tl.exp(best - new_safe)
        beta = tl.exp(m - new_safe)
        total = total * alpha + tl.load(l_ptr + row, cache_modifier=".cg") * beta
        part = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg")
        out = out * alpha[:, None] + part * beta[:, None]
        best = new
    out = out / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        out_ptr + b * o_sb + h * o_sh + r[:, None] * o_sr + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(r < ROWS)[:, None],
    )


@triton.jit
def decode_attention_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    ROWS,
    KV_HEADS,
    SPLITS,
    o_sb,
    o_sh,
    o_sr,
    ROWS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Merge the chunks of one (batch, KV head): the second launch of the two-launch form."""
    _merge_chunks(
        m_ptr,
        l_ptr,
        acc_ptr,
        out_ptr,
        tl.program_id(0),
        ROWS,
        KV_HEADS,
        SPLITS,
        o_sb,
        o_sh,
        o_sr,
        ROWS_PAD,
        HEAD_DIM,
    )


@triton.jit
def _prefetch_cache(
    base, SLOTS, slot_stride, ROW_BYTES: tl.constexpr, ELEMENT: tl.constexpr, THREADS: tl.constexpr
):
    """L2 prefetch of slots ``0 .. SLOTS - 1`` (``ROW_BYTES`` of each, ``slot_stride`` elements
    of ``ELEMENT`` bytes apart) from ``base``, ``THREADS`` rows a pass."""
    for start in range(0, SLOTS, THREADS):
        _l2_prefetch_rows(
            base + start * slot_stride,
            slot_stride * ELEMENT,
            ROW_BYTES,
            SLOTS - start,
        )


@triton.jit
def _prefetch_bytes(base, nbytes, part, parts, THREADS: tl.constexpr):
    """L2 prefetch of this program's share (``part`` of ``parts``) of the ``nbytes`` bytes at
    ``base`` (an int8 pointer), in 4 KiB requests, ``THREADS`` a pass (a tail of less than one
    request is left out)."""
    CHUNK: tl.constexpr = 4096
    chunks = nbytes // CHUNK
    per = tl.cdiv(chunks, parts)
    first = part * per
    mine = tl.maximum(tl.minimum(per, chunks - first), 0)
    for start in range(0, mine, THREADS):
        _l2_prefetch_rows(base + (first + start).to(tl.int64) * CHUNK, CHUNK, CHUNK, mine - start)


@triton.jit
def _online_chunk(
    q, k, v, mask_ptr, b, h, r, s, r_ok, s_ok, mask_sb, mask_sh, mask_sr, mask_ss, scale,
    best, total, acc, IEEE: tl.constexpr,
):  # fmt: skip
    """One chunk of the online softmax: ``(best, total, acc)`` after the keys ``k`` and values
    ``v`` of slots ``s``."""
    scores = _chunk_scores(
        q, k, mask_ptr, b, h, r, s, r_ok, s_ok, mask_sb, mask_sh, mask_sr, mask_ss, scale, IEEE
    )
    new = tl.maximum(best, tl.max(scores, axis=1))
    new_safe = tl.where(new == float("-inf"), 0.0, new)
    alpha = tl.exp(best - new_safe)
    p = tl.exp(scores - new_safe[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted_values(p, v, IEEE)
    return new, total, acc


@triton.jit
def decode_attention_loop_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    ROWS,
    SLOTS,
    KV_HEADS,
    scale,
    q_sb,
    q_sh,
    q_sr,
    k_sb,
    k_sh,
    k_ss,
    v_sb,
    v_sh,
    v_ss,
    mask_sb,
    mask_sh,
    mask_sr,
    mask_ss,
    o_sb,
    o_sh,
    o_sr,
    new_ptr,
    NEW,
    w1_ptr,
    W1_BYTES,
    w2_ptr,
    W2_BYTES,
    ROWS_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    STAGES: tl.constexpr = 3,
    GDC: tl.constexpr = False,
    TRIGGER: tl.constexpr = 0,  # TRIGGER_POINTS: where the next kernel may launch
    D_SPLIT: tl.constexpr = 1,
    PREFETCH: tl.constexpr = False,
    THREADS: tl.constexpr = 128,
    ELEMENT: tl.constexpr = 2,  # bytes per cache element (PREFETCH)
    PRELOAD: tl.constexpr = False,
    NEW_PAD: tl.constexpr = 2,
    WEIGHTS: tl.constexpr = 0,  # WEIGHT_PREFETCH_POINTS: when the next weights are prefetched
):
    """One program per (batch, KV head) walks the cache in ``BLOCK_S`` chunks with the online
    softmax (the chunks' loads pipelined ``STAGES`` deep) and stores the output rows: no
    partials, no merge. For short caches, where the split form's partial stores, arrival
    counter and merge cost more latency than the serial chunks. ``GDC`` as in the split form;
    ``TRIGGER`` (see :data:`TRIGGER_POINTS`): where every program lets the next kernel launch
    (1: at its start, 2: once its early loads are issued, 3: after its wait; 0: when it ends).
    ``D_SPLIT``: the head's output features are cut over that many programs
    (axis 1), each scoring all keys (the same scores, so the same softmax) but reading and
    writing ``HEAD_DIM / D_SPLIT`` value features: more SMs each loading fewer bytes.
    ``PREFETCH`` (with ``GDC``, sm_90; ``THREADS``: the program's threads): before the wait,
    every program asks L2 for its keys and value features of all ``SLOTS`` slots (a prefetch:
    L2 is where the QKV kernel's cache write lands, so a slot written after it is still read
    right), so the loop after the wait reads them from L2 rather than HBM.
    ``PRELOAD``: the first chunk's keys and values are loaded before the wait, except the
    ``NEW`` slots listed at ``new_ptr`` (those the previous kernel writes; the list itself must
    be written before that kernel, as a CUDA graph's static slot input is), which are loaded
    again after it (from L2: ``.cg``, never a line of this program's own early load).
    ``WEIGHTS`` (sm_90; 1: before the wait, 2: after it): the programs share an L2 prefetch of
    the ``W1_BYTES`` at ``w1_ptr`` and ``W2_BYTES`` at ``w2_ptr`` (the next kernel's weight,
    which attention's latency-bound loads leave HBM idle to stream)."""
    bh = tl.program_id(0)
    b = (bh // KV_HEADS).to(tl.int64)
    h = (bh % KV_HEADS).to(tl.int64)
    DV: tl.constexpr = HEAD_DIM // D_SPLIT
    dv = tl.program_id(1) * DV + tl.arange(0, DV)
    d = tl.arange(0, HEAD_DIM)
    k_head = k_ptr + b * k_sb + h * k_sh
    v_head = v_ptr + b * v_sb + h * v_sh
    if TRIGGER == 1:
        gdc_launch_dependents()
    if PRELOAD:  # written by earlier steps: ours to read before the wait
        s0 = tl.arange(0, BLOCK_S)
        s0_ok = s0 < SLOTS
        k0 = tl.load(k_head + s0[:, None] * k_ss + d[None, :], mask=s0_ok[:, None], other=0.0)
        v0 = tl.load(v_head + s0[:, None] * v_ss + dv[None, :], mask=s0_ok[:, None], other=0.0)
        n = tl.arange(0, NEW_PAD)
        written = tl.load(new_ptr + n, mask=n < NEW, other=-1)
        fresh = tl.max((s0[:, None] == written[None, :]).to(tl.int32), axis=1) > 0
    if GDC:
        if PREFETCH:
            _prefetch_cache(k_head, SLOTS, k_ss, HEAD_DIM * ELEMENT, ELEMENT, THREADS)
            _prefetch_cache(
                v_head + tl.program_id(1) * DV, SLOTS, v_ss, DV * ELEMENT, ELEMENT, THREADS
            )
    part = bh * D_SPLIT + tl.program_id(1)
    parts = tl.num_programs(0) * D_SPLIT
    if WEIGHTS == 1:
        _prefetch_bytes(w1_ptr, W1_BYTES, part, parts, THREADS)
        _prefetch_bytes(w2_ptr, W2_BYTES, part, parts, THREADS)
    if TRIGGER == 2:
        gdc_launch_dependents()
    if GDC:
        gdc_wait()
    if TRIGGER == 3:
        gdc_launch_dependents()
    if WEIGHTS == 2:
        _prefetch_bytes(w1_ptr, W1_BYTES, part, parts, THREADS)
        _prefetch_bytes(w2_ptr, W2_BYTES, part, parts, THREADS)
    r = tl.arange(0, ROWS_PAD)
    r_ok = r < ROWS
    q = tl.load(
        q_ptr + b * q_sb + h * q_sh + r[:, None] * q_sr + d[None, :], mask=r_ok[:, None], other=0.0
    )
    best = tl.full((ROWS_PAD,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((ROWS_PAD,), dtype=tl.float32)
    acc = tl.zeros((ROWS_PAD, DV), dtype=tl.float32)
    first = 0
    if PRELOAD:  # the slots the previous kernel wrote, then the first chunk
        again = fresh[:, None] & s0_ok[:, None]
        k_new = tl.load(
            k_head + s0[:, None] * k_ss + d[None, :], mask=again, other=0.0, cache_modifier=".cg"
        )
        v_new = tl.load(
            v_head + s0[:, None] * v_ss + dv[None, :], mask=again, other=0.0, cache_modifier=".cg"
        )
        k0 = tl.where(again, k_new, k0)
        v0 = tl.where(again, v_new, v0)
        best, total, acc = _online_chunk(
            q, k0, v0, mask_ptr, b, h, r, s0, r_ok, s0_ok, mask_sb, mask_sh, mask_sr, mask_ss,
            scale, best, total, acc, IEEE,
        )  # fmt: skip
        first = BLOCK_S
    for start in tl.range(first, SLOTS, BLOCK_S, num_stages=STAGES):
        s = start + tl.arange(0, BLOCK_S)
        s_ok = s < SLOTS
        k = tl.load(k_head + s[:, None] * k_ss + d[None, :], mask=s_ok[:, None], other=0.0)
        v = tl.load(v_head + s[:, None] * v_ss + dv[None, :], mask=s_ok[:, None], other=0.0)
        best, total, acc = _online_chunk(
            q, k, v, mask_ptr, b, h, r, s, r_ok, s_ok, mask_sb, mask_sh, mask_sr, mask_ss, scale,
            best, total, acc, IEEE,
        )  # fmt: skip
    acc = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(
        out_ptr + b * o_sb + h * o_sh + r[:, None] * o_sr + dv[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None],
    )


# Caches of at most this many slots take the loop form (one program per KV head, no merge);
# longer ones the split form (0: always). At 192 slots (8B Llama, batch 1, 8 KV heads x 4
# rows) the whole decode step of an H100 took 5.755 ms with the loop form against 5.808 with
# the split form's 64-slot chunks and 5.845 with its 32-slot ones (GPU call B1,
# tools/bench/bf16_decode_variants.py; with 32-slot loop chunks 5.701 against 5.716 at 64 in
# call B2, medians the other way: kept at 64); longer caches were not measured: the split form.
LOOP_MAX_SLOTS = 256
LOOP_BLOCK_S = 64  # slots per chunk of the loop form
LOOP_STAGES = 3  # chunks in flight in the loop form
LOOP_WARPS = 4  # warps per program of the loop form
# Programs per (batch, KV head) of the loop form, each a slice of head_dim's value features
# (every one scores all keys), while the programs stay at most one per multiprocessor (more
# SMs loading fewer bytes each; never past that: more programs then only re-read the keys),
# and each slice keeps at least 16 features. At batch 1 of an 8B Llama (8 KV heads, 192
# slots) on an H100: attention alone 4.58 us a call against 5.34 (a CUDA graph of 32 calls),
# the int4 step 2.3187 against 2.3410 ms and the bf16 step 5.7093 against 5.7190 (call G,
# tools/bench/quant_decode_variants.py, one process, 2 interleaved rounds; call D2: int4
# 2.3190 against 2.3406). 4 was slower (4.80 us; int4 2.3454 with PDL and prefetch).
LOOP_D_SPLIT = 2
# decode_attention's ``trigger`` values: where its programs let the next kernel launch (the
# split form: "start" only)
TRIGGER_POINTS = {False: 0, True: 1, "start": 1, "issued": 2, "waited": 3}
# decode_attention's ``weights_when`` values: when its programs prefetch ``weights`` into L2
WEIGHT_PREFETCH_POINTS = {"early": 1, "waited": 2}


def default_block_s(slots: int, programs_per_chunk: int, device: torch.device) -> int:
    """Slots per chunk: 64 while that keeps the chunk count moderate, else 128 (the merge
    walks the chunks serially). At batch-1 decode of an 8B Llama (8 KV heads, 192 slots) one
    H200 call took 5.96 us at 64 against 7.0 at 32 (tools/bench/bf16_gemv_bench.py)."""
    block = 64
    while block < 128 and triton.cdiv(slots, block) > 64:
        block *= 2
    return block


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    block_s: int | None = None,
    merge: bool = MERGE_IN_SPLIT,
    pdl: bool = False,
    loop: bool | None = None,
    trigger: bool | str = False,
    prefetch: bool = False,
    stages: int | None = None,
    warps: int | None = None,
    d_split: int | None = None,
    new_slots: torch.Tensor | None = None,
    weights: tuple[torch.Tensor, ...] = (),
    weights_when: str = "waited",
) -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.decode_attention.reference.decode_attention`.
    ``loop``: one program per KV head walking the chunks (None: for caches of at most
    :data:`LOOP_MAX_SLOTS` slots when ``block_s`` is not given); else the split form.
    ``merge``: one launch (the last chunk program of each head merges) instead of two.
    ``pdl`` (the loop form, or the split form with ``merge``; sm_90+): launched with
    programmatic dependent launch: its programs may start while the previous kernel finishes
    and wait for it (``griddepcontrol.wait``) before reading. ``trigger`` (NVIDIA sm_90+):
    every program lets the next kernel launch at once (``griddepcontrol.launch_dependents``),
    with or without ``pdl``; only a kernel launched with programmatic dependent launch (the
    fused quantized output projection) starts early, to prefetch its weight while attention
    runs (without it, the next kernel launches when attention ends); ``"issued"`` lets it
    launch once the early loads (``prefetch``, ``new_slots``, ``weights``) are issued,
    ``"waited"`` after the wait (True: ``"start"``; the split form, which has no early loads:
    both after the wait). ``prefetch`` (the loop form with ``pdl``, sm_90+): before the wait
    each program asks L2 for its keys and values. The split form ignores ``prefetch``,
    ``new_slots`` and ``weights`` (early-load hints).
    The loop form's ``block_s`` (default :data:`LOOP_BLOCK_S`), ``stages``
    (:data:`LOOP_STAGES`), ``warps`` (:data:`LOOP_WARPS`) and ``d_split`` (programs per KV
    head, each ``head_dim / d_split`` output features; default :data:`LOOP_D_SPLIT` while the
    programs fit one per multiprocessor, else 1) change the launch; ``stages`` and ``d_split``
    not the result (a different ``block_s`` sums in other chunks, ``warps`` lays the dots out
    differently: the same within rounding). ``new_slots`` (the loop form; a 1-D integer tensor
    on the device, every batch row's new slots): the cache slots the previous kernel writes
    (the quantized QKV's epilogue); the program loads its first chunk's other keys and values
    before it waits (with ``pdl``) and those slots after; the list must be written before that
    previous kernel runs (a CUDA graph's static slot input). ``weights`` (the loop form,
    NVIDIA sm_90; up to two contiguous tensors, e.g. the next projection's codes and scales):
    the programs prefetch their bytes into L2, before their wait (``weights_when="early"``) or
    after it (``"waited"``). Head sizes that are not a power of two in [16, 256],
    more than ``MAX_ROWS`` rows per KV head, a mask that does not broadcast as ``(batch, 1 or
    kv_heads, rows, slots)`` or autograd: the reference."""
    check_kernel_device("decode_attention", query, key, value, mask)
    check_shapes(query, key, value)
    batch, kv_heads, rows, head_dim = query.shape
    slots = key.shape[2]
    if (
        head_dim not in (16, 32, 64, 128, 256)
        or rows > MAX_ROWS
        or mask.dim() != 4
        or mask.shape[-2:] != (rows, slots)
        or mask.shape[1] not in (1, kv_heads)
        or mask.shape[0] not in (1, batch)
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or query.stride(-1) != 1
        or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
    ):
        return reference(query, key, value, mask, scale)
    rows_pad = max(16, next_power_of_2(rows))
    mask_strides = [0 if mask.shape[i] == 1 else mask.stride(i) for i in range(4)]
    mask_strides[2:] = [mask.stride(2), mask.stride(3)]
    out = torch.empty(batch, kv_heads, rows, head_dim, device=query.device, dtype=query.dtype)
    if trigger not in TRIGGER_POINTS:
        raise ValueError(
            f"decode_attention: trigger={trigger!r}: one of False, True, 'start', 'issued', "
            "'waited'"
        )
    if len(weights) > 2 or weights_when not in WEIGHT_PREFETCH_POINTS:
        raise ValueError(
            f"decode_attention: weights takes up to two tensors (got {len(weights)}) and "
            f"weights_when one of {sorted(WEIGHT_PREFETCH_POINTS)} (got {weights_when!r})"
        )
    if new_slots is not None and (
        new_slots.dim() != 1 or new_slots.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            "decode_attention: new_slots must be a 1-D int32/int64 tensor of the slots the "
            f"previous kernel writes, got {new_slots.dtype} {tuple(new_slots.shape)}"
        )
    weight_args = _weight_args(weights, out)  # checked on every device and form
    if loop is None:
        loop = block_s is None and slots <= LOOP_MAX_SLOTS
    can_trigger = pdl_supported(query.device)
    if loop:
        gdc = pdl and pdl_supported(query.device)
        warps = warps or LOOP_WARPS
        if d_split is None:
            d_split = _default_d_split(batch * kv_heads, head_dim, query.device)
        if d_split < 1 or head_dim % d_split or head_dim // d_split < 16:
            raise ValueError(
                f"decode_attention: d_split={d_split} must divide head_dim {head_dim} into "
                "slices of at least 16 features"
            )
        block_s = block_s or LOOP_BLOCK_S
        stages = _loop_stages(
            stages or LOOP_STAGES, block_s, slots, head_dim, d_split, key.element_size(), key.device
        )
        decode_attention_loop_kernel[(batch * kv_heads, d_split)](
            query,
            key,
            value,
            mask,
            out,
            rows,
            slots,
            kv_heads,
            scale,
            query.stride(0),
            query.stride(1),
            query.stride(2),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            value.stride(0),
            value.stride(1),
            value.stride(2),
            *mask_strides,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            out if new_slots is None else new_slots,
            0 if new_slots is None else new_slots.numel(),
            *(weight_args if can_trigger else _weight_args((), out)),
            ROWS_PAD=rows_pad,
            BLOCK_S=block_s,
            HEAD_DIM=head_dim,
            IEEE=query.dtype == torch.float32,
            STAGES=stages,
            GDC=gdc,
            TRIGGER=TRIGGER_POINTS[trigger] if can_trigger else 0,
            D_SPLIT=d_split,
            PREFETCH=prefetch and gdc,
            THREADS=32 * warps,
            ELEMENT=key.element_size(),
            PRELOAD=new_slots is not None,
            NEW_PAD=next_power_of_2(max(2, 0 if new_slots is None else new_slots.numel())),
            WEIGHTS=WEIGHT_PREFETCH_POINTS[weights_when] if weights and can_trigger else 0,
            num_warps=warps,
            **({"launch_pdl": True} if gdc else {}),
        )
        return out
    block_s = block_s or default_block_s(slots, batch * kv_heads, query.device)
    splits = triton.cdiv(slots, block_s)
    partial = batch * kv_heads * splits * rows_pad
    m = torch.empty(partial, device=query.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = torch.empty(partial, head_dim, device=query.device, dtype=torch.float32)
    counter = arrival_counters("decode_attention", query.device, batch * kv_heads) if merge else m
    gdc = pdl and merge and pdl_supported(query.device)
    decode_attention_split_kernel[(splits, batch * kv_heads)](
        query,
        key,
        value,
        mask,
        m,
        l_sum,
        acc,
        rows,
        slots,
        kv_heads,
        splits,
        scale,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        *mask_strides,
        out,
        counter,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        ROWS_PAD=rows_pad,
        BLOCK_S=block_s,
        HEAD_DIM=head_dim,
        IEEE=query.dtype == torch.float32,
        MERGE=merge,
        TRIGGER=TRIGGER_POINTS[trigger] if can_trigger else 0,
        GDC=gdc,
        num_warps=4,
        **({"launch_pdl": True} if gdc else {}),
    )
    if not merge:
        decode_attention_combine_kernel[(batch * kv_heads,)](
            m,
            l_sum,
            acc,
            out,
            rows,
            kv_heads,
            splits,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            ROWS_PAD=rows_pad,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out


def _default_d_split(programs: int, head_dim: int, device: torch.device) -> int:
    """:data:`LOOP_D_SPLIT` while ``programs`` (batch x KV heads) times it fit one per
    multiprocessor and each slice of ``head_dim`` keeps 16 features; else 1 (also off GPUs)."""
    if device.type != "cuda" or LOOP_D_SPLIT <= 1:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    if programs * LOOP_D_SPLIT > sms or head_dim % LOOP_D_SPLIT or head_dim < 16 * LOOP_D_SPLIT:
        return 1
    return LOOP_D_SPLIT


def _loop_stages(
    stages: int,
    block_s: int,
    slots: int,
    head_dim: int,
    d_split: int,
    element: int,
    device: torch.device,
) -> int:
    """The loop form's pipeline depth: 1 when the cache is one chunk (nothing to overlap),
    else ``stages`` less while the chunks in flight (keys and the program's value features)
    would not fit in three quarters of the device's shared memory (a launch Triton refuses)."""
    if block_s >= slots:
        return 1
    limit = 100 * 1024
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        limit = int(getattr(props, "shared_memory_per_block_optin", limit))
    per_stage = block_s * (head_dim + head_dim // d_split) * element
    while stages > 1 and (stages - 1) * per_stage > 0.75 * limit:
        stages -= 1
    return stages


def _weight_args(weights: tuple[torch.Tensor, ...], dummy: torch.Tensor) -> list[object]:
    """``w1_ptr, W1_BYTES, w2_ptr, W2_BYTES`` of the loop kernel: each tensor's storage as
    bytes (contiguous tensors only; a missing one: 0 bytes)."""
    found: list[object] = []
    for index in range(2):
        if index < len(weights):
            tensor = weights[index]
            if not tensor.is_contiguous() or tensor.device != dummy.device:
                raise ValueError(
                    "decode_attention: the weights to prefetch must be contiguous tensors on "
                    f"{dummy.device}, got {tuple(tensor.shape)} on {tensor.device}"
                )
            found += [tensor.view(torch.int8), tensor.numel() * tensor.element_size()]
        else:
            found += [dummy.view(torch.int8), 0]
    return found


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("bf16", "fp16"):
        signature = {
            "q_ptr": f"*{dtype}",
            "k_ptr": f"*{dtype}",
            "v_ptr": f"*{dtype}",
            "mask_ptr": f"*{dtype}",
            "m_ptr": "*fp32",
            "l_ptr": "*fp32",
            "acc_ptr": "*fp32",
        }
        signature.update(
            {
                name: "i32"
                for name in (
                    "ROWS",
                    "SLOTS",
                    "KV_HEADS",
                    "SPLITS",
                )
            }
        )
        signature["scale"] = "fp32"
        signature.update(
            {
                name: "i32"
                for name in (
                    "q_sb",
                    "q_sh",
                    "q_sr",
                    "k_sb",
                    "k_sh",
                    "k_ss",
                    "v_sb",
                    "v_sh",
                    "v_ss",
                    "mask_sb",
                    "mask_sh",
                    "mask_sr",
                    "mask_ss",
                )
            }
        )
        signature.update(
            {
                "out_ptr": f"*{dtype}",
                "counter_ptr": "*i32",
                "o_sb": "i32",
                "o_sh": "i32",
                "o_sr": "i32",
                "ROWS_PAD": "constexpr",
                "BLOCK_S": "constexpr",
                "HEAD_DIM": "constexpr",
                "IEEE": "constexpr",
                "MERGE": "constexpr",
                "TRIGGER": "constexpr",
                "GDC": "constexpr",
            }
        )
        specs.append(
            AotSpec(
                f"decode_attention.split[{dtype}]",
                decode_attention_split_kernel,
                signature,
                {
                    "ROWS_PAD": 16,
                    "BLOCK_S": 32,
                    "HEAD_DIM": 128,
                    "IEEE": False,
                    "MERGE": True,
                    "TRIGGER": 0,
                    "GDC": False,
                },
            )
        )
        loop_signature = {name: signature[name] for name in ("q_ptr", "k_ptr", "v_ptr", "mask_ptr")}
        loop_signature["out_ptr"] = f"*{dtype}"
        loop_signature.update({name: "i32" for name in ("ROWS", "SLOTS", "KV_HEADS")})
        loop_signature["scale"] = "fp32"
        strides = ["q_sb", "q_sh", "q_sr", "k_sb", "k_sh", "k_ss", "v_sb", "v_sh", "v_ss"]
        strides += ["mask_sb", "mask_sh", "mask_sr", "mask_ss", "o_sb", "o_sh", "o_sr"]
        loop_signature.update({name: "i32" for name in strides})
        loop_signature.update({"new_ptr": "*i64", "NEW": "i32"})
        loop_signature.update({"w1_ptr": "*i8", "W1_BYTES": "i32", "w2_ptr": "*i8"})
        loop_signature["W2_BYTES"] = "i32"
        loop_constexprs = ["ROWS_PAD", "BLOCK_S", "HEAD_DIM", "IEEE", "STAGES", "GDC", "TRIGGER"]
        loop_constexprs += ["D_SPLIT", "PREFETCH", "THREADS", "ELEMENT", "PRELOAD", "NEW_PAD"]
        loop_constexprs += ["WEIGHTS"]
        for name in loop_constexprs:
            loop_signature[name] = "constexpr"
        specs.append(
            AotSpec(
                f"decode_attention.loop[{dtype}]",
                decode_attention_loop_kernel,
                loop_signature,
                {
                    "ROWS_PAD": 16,
                    "BLOCK_S": 64,
                    "HEAD_DIM": 128,
                    "IEEE": False,
                    "STAGES": 3,
                    "GDC": False,
                    "TRIGGER": 0,
                    "D_SPLIT": 1,
                    "PREFETCH": False,
                    "THREADS": 128,
                    "ELEMENT": 2,
                    "PRELOAD": False,
                    "NEW_PAD": 2,
                    "WEIGHTS": 0,
                },
            )
        )
        specs.append(
            AotSpec(
                f"decode_attention.combine[{dtype}]",
                decode_attention_combine_kernel,
                {
                    "m_ptr": "*fp32",
                    "l_ptr": "*fp32",
                    "acc_ptr": "*fp32",
                    "out_ptr": f"*{dtype}",
                    "ROWS": "i32",
                    "KV_HEADS": "i32",
                    "SPLITS": "i32",
                    "o_sb": "i32",
                    "o_sh": "i32",
                    "o_sr": "i32",
                    "ROWS_PAD": "constexpr",
                    "HEAD_DIM": "constexpr",
                },
                {"ROWS_PAD": 16, "HEAD_DIM": 128},
            )
        )
    return specs
