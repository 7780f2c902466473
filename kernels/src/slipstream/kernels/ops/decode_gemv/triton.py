"""Triton decode GEMV: a few activation rows times a dense weight, streamed once at full width.

Decode at batch 1 multiplies one activation row by every weight of the model once, so each
projection is a matrix-vector product bound by how fast the weight streams from memory. Program
``(n, row)`` owns ``BLOCK_N`` output features (whole weight rows: no split-K, so no atomics, no
zero-fill and no cast launches); it walks K in ``BLOCK_K`` steps, loading a ``(BLOCK_N,
BLOCK_K)`` tile with 16-byte vector loads along the contiguous input dimension (marked
evict-first: each weight byte is read once), multiplying it by the step's activations in fp32
and keeping a 2-D fp32 accumulator that is reduced once at the end.

The kernel also takes over the small kernels around the projection, which at batch 1 cost more
in launches than in bytes (``PROLOGUE``):

- ``0``: plain ``x @ W.T``;
- ``1``: residual add + RMSNorm first (``norm_gemv``): every program reads the (tiny) input row
  and its residual, computes the row's inverse RMS itself, and normalises each step's slice as
  it streams; program 0 also writes ``x + residual`` for the next block. The normalised value
  is rounded to the activation dtype exactly where ``add_rms_norm`` rounds it;
- ``2``: SwiGLU first (``gated_gemv``): the input row is ``[gate, up]`` and each step computes
  ``silu(gate) * up`` with ``gated_activation``'s two roundings.

and, for the QKV projection at decode (``norm_gemv_rotary``, launch field ``fold_rotary``), the
kernel after it: ``rotary_kv_write``'s rotation and cache write in the epilogue (``ROPE``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.decode_gemv.reference import decode_gemv as reference_gemv
from slipstream.kernels.ops.decode_gemv.reference import gated_gemv as reference_gated
from slipstream.kernels.ops.decode_gemv.reference import norm_gemv as reference_norm
from slipstream.kernels.ops.decode_gemv.table import DecodeGemvConfig, default_rule, lookup_launch
from slipstream.kernels.ops.quant_matmul.gemv import _fixup_scratch
from slipstream.kernels.triton_support import AotSpec, check_kernel_device, pdl_supported

__all__ = [
    "MAX_ROWS",
    "DecodeGemvConfig",
    "decode_gemv",
    "default_config",
    "gated_gemv",
    "launch_config",
    "norm_gemv",
    "norm_gemv_rotary",
]

MAX_ROWS = 4  # above this many rows the weight is better read once by a matmul: the reference

PLAIN, NORM, GATED = 0, 1, 2
_FUSION_NAMES = {PLAIN: "plain", NORM: "norm", GATED: "gated"}  # the launch table's names
try:  # grid-dependency control (programmatic dependent launch), Triton >= 3.3 on CUDA
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc  # noqa: F401

    _HAS_GDC = True
except ImportError:
    _HAS_GDC = False


@triton.jit
def _l2_prefetch_rows(first_row, row_stride, row_bytes, rows):
    """``cp.async.bulk.prefetch.L2`` of ``row_bytes`` (a multiple of 16) from each of ``rows``
    rows ``row_stride`` bytes apart from ``first_row`` on (NVIDIA sm_90): thread ``t < rows``
    of the program requests row ``t``, so each row is asked for once whatever the tensor
    layouts (decode_attention prefetches its cache rows with it too)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .u32 t;
        .reg .u64 a, off;
        mov.u32 t, %tid.x;
        setp.lt.u32 p, t, $4;
        mul.wide.u32 off, t, $2;
        add.u64 a, $1, off;
        @p cp.async.bulk.prefetch.L2.global [a], $3;
        mov.u32 $0, 0;
        }""",
        "=r,l,r,r,r",
        [first_row, row_stride, row_bytes, rows],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _block_cols(block, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The output features of ``block``: ``BLOCK_N`` consecutive ones, or with ``ROPE`` the
    rotary pairs of one head (``BLOCK_N / 2`` features from its first half and the same ones
    ``HEAD_DIM / 2`` later), so that the epilogue can rotate them."""
    i = tl.arange(0, BLOCK_N)
    if ROPE:
        per_head = HEAD_DIM // BLOCK_N
        first = (block % per_head) * (BLOCK_N // 2)
        cols = (block // per_head) * HEAD_DIM + first + i % (BLOCK_N // 2)
        return cols + (i // (BLOCK_N // 2)) * (HEAD_DIM // 2)
    return block * BLOCK_N + i


@triton.jit
def _rope_store(
    y,
    block,
    row,
    q_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    trig_stride,
    cache_sb,
    cache_sh,
    cache_ss,
    BLOCK_N: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """``rotary_kv_write`` of one ROPE block (``y``: its outputs, fp32 values of the QKV
    dtype): rotate a query or key head's pairs, store to the queries or a cache."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    per_head = HEAD_DIM // BLOCK_N
    head = block // per_head
    first = (block % per_head) * HALF_N + tl.arange(0, HALF_N)
    lo, hi = tl.split(tl.permute(tl.reshape(y, (2, HALF_N)), (1, 0)))
    if head < HEADS + KV_HEADS:
        c = tl.load(cos_ptr + row * trig_stride + first).to(tl.float32)
        s = tl.load(sin_ptr + row * trig_stride + first).to(tl.float32)
        lo, hi = lo * c - hi * s, hi * c + lo * s
    if head < HEADS:
        dest = q_ptr + (row * HEADS + head) * HEAD_DIM
    else:
        kv = head - HEADS
        cache = kc_ptr
        if kv >= KV_HEADS:
            kv -= KV_HEADS
            cache = vc_ptr
        slot = tl.load(slots_ptr)
        dest = cache + row * cache_sb + kv * cache_sh + slot * cache_ss
    tl.store(dest + first, lo.to(q_ptr.dtype.element_ty))
    tl.store(dest + first + HEAD_DIM // 2, hi.to(q_ptr.dtype.element_ty))


@triton.jit
def decode_gemv_kernel(
    x_ptr,
    r_ptr,
    nw_ptr,
    total_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,  # FIXUP: fp32 (rows, N) partial sums, zero at rest
    count_ptr,  # FIXUP: int32 arrival counters, one per (row, block of outputs), zero at rest
    N,
    K,
    x_stride,
    y_stride,
    eps,
    cos_ptr,  # ROPE: (rows, HEAD_DIM / 2) rotary tables of the token, row stride trig_stride
    sin_ptr,
    kc_ptr,  # ROPE: key / value caches (rows, KV_HEADS, slots, HEAD_DIM), slot at slots_ptr
    vc_ptr,
    slots_ptr,
    trig_stride,
    cache_sb,
    cache_sh,
    cache_ss,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
    FIXUP: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,
    NORM_BLOCK: tl.constexpr = 1024,
    L2_PREFETCH: tl.constexpr = False,
    L2_BLOCKS: tl.constexpr = 0,
    DEFER_NORM: tl.constexpr = False,
    LATE_TRIGGER: tl.constexpr = False,
    ROPE: tl.constexpr = False,
    HEADS: tl.constexpr = 1,
    KV_HEADS: tl.constexpr = 1,
    HEAD_DIM: tl.constexpr = 128,
):
    """``y[row, n] = sum_k W[n, k] * h[row, k] (+ b[n])`` with ``h`` the prologue's input.
    ``PREFETCH``: each step loads the next step's weight tile before its own math (two tiles in
    flight per program; Triton does not software-pipeline loads that feed no dot).

    Program ``p`` of ``P`` computes row blocks ``p, p + P, ...`` (``P`` = the grid's first
    dimension: one block each when the grid covers every block, persistent otherwise, so the
    norm prologue runs once per program and the last wave is finer-grained).

    ``SPLIT_K`` > 1: the grid's third dimension cuts K into that many ranges of whole steps.
    ``FIXUP``: each split adds its fp32 sums into the workspace ``ws_ptr`` and the last to
    arrive (counted in ``count_ptr``) takes the total, leaving both zeroed, and writes the
    output with the bias; else the splits add into a zeroed fp32 output (bias from split 0).

    ``EARLY``: the program's first weight tile is loaded before anything else (weights are
    never written by the kernels before this one). ``USE_GDC`` (launched with programmatic
    dependent launch, sm_90+): then the program waits for the previous kernel of the stream to
    finish (every read of activations and every store comes after), and lets the next kernel's
    programs start, so a GEMV following this one loads its first tile while this one runs
    (``LATE_TRIGGER``: only once the program has streamed its last block's weights, so that
    the next kernel's programs do not hold SM slots while this one streams).
    ``L2_PREFETCH`` (with ``USE_GDC``): before the wait, the whole rows of every block of
    outputs the program will compute (of its first ``L2_BLOCKS``, when > 0) are prefetched
    into L2, one bulk request per row, so that a small weight streams from memory while the
    kernels before it (attention) run.

    ``DEFER_NORM`` (``PROLOGUE`` 1, no split-K): no pass over the row before the weights stream;
    the K loop sums ``W @ (total * norm_weight)`` and ``total**2`` together and the sum is
    scaled by ``1 / rms`` at the end (the normalised input is not rounded to the activation
    dtype, as ``add_rms_norm`` rounds it: a difference of that rounding's order).

    ``ROPE`` (the QKV projection of one token per row, no split-K; ``rotary_kv_write``'s work
    in the epilogue): each block holds rotary pairs of one head (:func:`_block_cols`); the
    outputs are rounded as the QKV output would be, the query and key heads rotated in fp32,
    the queries stored to ``y`` as ``(rows, HEADS, HEAD_DIM)`` and the keys and values into the
    caches at the slot."""
    pid_n = tl.program_id(0)
    programs = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2)
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * x_stride
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * per_split
    k_end = tl.minimum(k_begin + per_split, K)
    if EARLY:
        first_cols = _block_cols(pid_n, BLOCK_N, ROPE, HEAD_DIM)
        w_first = tl.load(
            w_ptr + first_cols[:, None].to(tl.int64) * K + (k_begin + k)[None, :],
            mask=(first_cols < N)[:, None] & (k_begin + k < k_end)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    if USE_GDC:
        if L2_PREFETCH:
            row_bytes = K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
            # each thread asks for one row: BLOCK_N <= 32 * num_warps (checked at launch)
            last = tl.cdiv(N, BLOCK_N)
            if L2_BLOCKS > 0:
                last = tl.minimum(last, pid_n + L2_BLOCKS * programs)
            for ahead in range(pid_n, last, programs):
                if ROPE:  # the block's two runs of BLOCK_N / 2 rows, HEAD_DIM / 2 apart
                    per_head = HEAD_DIM // BLOCK_N
                    start = (ahead // per_head) * HEAD_DIM + (ahead % per_head) * (BLOCK_N // 2)
                    run = w_ptr + start.to(tl.int64) * K
                    _l2_prefetch_rows(run, row_bytes, row_bytes, BLOCK_N // 2)
                    _l2_prefetch_rows(run + (HEAD_DIM // 2) * K, row_bytes, row_bytes, BLOCK_N // 2)
                else:
                    start = ahead * BLOCK_N
                    rows_left = tl.minimum(N - start, BLOCK_N)
                    _l2_prefetch_rows(
                        w_ptr + start.to(tl.int64) * K, row_bytes, row_bytes, rows_left
                    )
        tl.extra.cuda.gdc_wait()
        if not LATE_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
    rstd = 0.0
    if PROLOGUE == 1 and not DEFER_NORM:
        # only program (0, row, 0) writes the residual sum
        store_end = tl.where((pid_n == 0) & (pid_k == 0), K, 0)
        # The row's inverse RMS: every program computes it (K elements from L2, a few percent of
        # the weight bytes it streams); program 0 also stores the residual sum.
        # In NORM_BLOCK-wide steps (the whole row for K <= NORM_BLOCK): each step is one L2
        # round trip that every program waits for before its first weight tile.
        nk = tl.arange(0, NORM_BLOCK)
        squares = 0.0
        for k0 in range(0, K, NORM_BLOCK):
            kk = k0 + nk
            k_ok = kk < K
            t = tl.load(x_row + kk, mask=k_ok, other=0.0, eviction_policy="evict_last")
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + row * K + kk, mask=k_ok, other=0.0)
                t = (t.to(tl.float32) + r.to(tl.float32)).to(total_ptr.dtype.element_ty)
                tl.store(total_ptr + row * K + kk, t, mask=kk < store_end)
            t = t.to(tl.float32)
            squares += tl.sum(t * t, axis=0)
        rstd = 1.0 / tl.sqrt(squares / K + eps)
    for block in range(pid_n, tl.cdiv(N, BLOCK_N), programs):
        cols = _block_cols(block, BLOCK_N, ROPE, HEAD_DIM)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if DEFER_NORM:
            block_squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
            # only the first block of program 0 writes the residual sum
            store_end = tl.where((pid_n == 0) & (block == pid_n), K, 0)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * K
        if PREFETCH:  # the first step's tile; each step then loads the next before its math
            if EARLY:
                if block == pid_n:
                    w_next = w_first
                else:
                    w_next = tl.load(
                        w_rows + (k_begin + k)[None, :],
                        mask=col_ok[:, None] & (k_begin + k < k_end)[None, :],
                        other=0.0,
                        eviction_policy="evict_first",
                    )
            else:
                w_next = tl.load(
                    w_rows + (k_begin + k)[None, :],
                    mask=col_ok[:, None] & (k_begin + k < k_end)[None, :],
                    other=0.0,
                    eviction_policy="evict_first",
                )
        for k0 in range(k_begin, k_end, BLOCK_K):
            kk = k0 + k
            k_ok = kk < K
            if PREFETCH:
                w = w_next
                ahead = kk + BLOCK_K
                w_next = tl.load(
                    w_rows + ahead[None, :],
                    mask=col_ok[:, None] & (ahead < k_end)[None, :],
                    other=0.0,
                    eviction_policy="evict_first",
                )
            elif EARLY:
                if (block == pid_n) & (k0 == k_begin):
                    w = w_first
                else:
                    w = tl.load(
                        w_rows + kk[None, :],
                        mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0,
                        eviction_policy="evict_first",
                    )
            elif EVEN_N and EVEN_K:
                w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(
                    w_rows + kk[None, :],
                    mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0,
                    eviction_policy="evict_first",
                )
            if PROLOGUE == 2:
                gate = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
                up = tl.load(x_row + K + kk, mask=k_ok, other=0.0)
                act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
                h = (act * up.to(tl.float32)).to(up.dtype).to(tl.float32)
            elif PROLOGUE == 1 and DEFER_NORM:
                t = tl.load(x_row + kk, mask=k_ok, other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(r_ptr + row * K + kk, mask=k_ok, other=0.0)
                    t = (t.to(tl.float32) + r.to(tl.float32)).to(total_ptr.dtype.element_ty)
                    tl.store(total_ptr + row * K + kk, t, mask=kk < store_end)
                h = t.to(tl.float32)
                block_squares += h * h
                if HAS_NORM_WEIGHT:
                    h = h * tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            elif PROLOGUE == 1:
                t = tl.load(x_row + kk, mask=k_ok, other=0.0)
                if HAS_RESIDUAL:
                    r = tl.load(r_ptr + row * K + kk, mask=k_ok, other=0.0)
                    t = (t.to(tl.float32) + r.to(tl.float32)).to(total_ptr.dtype.element_ty)
                h = t.to(tl.float32) * rstd
                if HAS_NORM_WEIGHT:
                    h = h * tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                h = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # where add_rms_norm rounds
            else:
                h = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * h[None, :]
        y = tl.sum(acc, axis=1)
        if USE_GDC and LATE_TRIGGER:
            if block + programs >= tl.cdiv(N, BLOCK_N):  # the program's last block: streamed
                tl.extra.cuda.gdc_launch_dependents()
        if DEFER_NORM:
            y = y / tl.sqrt(tl.sum(block_squares, axis=0) / K + eps)
        y_ptrs = y_ptr + row * y_stride + cols
        if ROPE:
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            _rope_store(
                y.to(y_ptr.dtype.element_ty).to(tl.float32),
                block,
                row,
                y_ptr,
                cos_ptr,
                sin_ptr,
                kc_ptr,
                vc_ptr,
                slots_ptr,
                trig_stride,
                cache_sb,
                cache_sh,
                cache_ss,
                BLOCK_N,
                HEADS,
                KV_HEADS,
                HEAD_DIM,
            )
        elif SPLIT_K == 1:
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=col_ok)
        elif FIXUP:
            ws_ptrs = ws_ptr + row * N + cols
            tl.atomic_add(ws_ptrs, y, mask=col_ok, sem="relaxed")
            tl.debug_barrier()
            counter = count_ptr + row * tl.cdiv(N, BLOCK_N) + block
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.atomic_xchg(ws_ptrs, tl.zeros_like(y), mask=col_ok, sem="relaxed")
                if HAS_BIAS:
                    total += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=col_ok)
                tl.atomic_xchg(counter, 0, sem="relaxed")
        else:
            if HAS_BIAS:
                bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                y += tl.where(pid_k == 0, bias, 0.0)
            tl.atomic_add(y_ptrs, y, mask=col_ok)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: NVIDIA sm_90+ and a Triton with grid-dependency control;
    elsewhere a ``pdl`` launch runs as a plain one (same results)."""
    return _HAS_GDC and pdl_supported(device)


def default_config(out_features: int, in_features: int, device: torch.device) -> DecodeGemvConfig:
    """The launch for a GPU or shape no launch table lists (:func:`~slipstream.kernels.ops.
    decode_gemv.table.default_rule` with ``device``'s SM count)."""
    return default_rule(out_features, in_features, _multiprocessors(device))


def launch_config(
    prologue: int, out_features: int, in_features: int, device: torch.device
) -> DecodeGemvConfig:
    """The launch used when none is given: ``prologue``'s entry for this shape and ``device``
    in the launch tables (the user's, then the built-in), else :func:`default_config`."""
    return lookup_launch(_FUSION_NAMES[prologue], out_features, in_features, device)[0]


def _supported(rows: int, weight: torch.Tensor, activation: torch.Tensor, k: int) -> bool:
    return (
        0 < rows <= MAX_ROWS
        and weight.dtype == activation.dtype
        and weight.dim() == 2
        and weight.shape[1] == k
        and weight.is_contiguous()
    )


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is on and some input wants a gradient: the (differentiable) reference runs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _launch(
    prologue: int,
    rows_view: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    total: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    config: DecodeGemvConfig | None,
    pdl: bool | None = None,
    rope: _Rope | None = None,
) -> torch.Tensor:
    out_features, in_features = weight.shape
    rows = rows_view.shape[0]
    config = config or launch_config(prologue, out_features, in_features, weight.device)
    if pdl is not None and pdl != config.pdl:
        config = dataclasses.replace(config, pdl=pdl)
    blocks = triton.cdiv(out_features, config.block_n)
    split = max(1, min(config.split_k, triton.cdiv(in_features, config.block_k)))
    if rope is not None:  # the epilogue needs a program's whole sums: no split-K
        split = 1
    scratch = None
    if split > 1:
        scratch = _fixup_scratch(weight.device, rows * out_features, rows * blocks)
    if rope is not None:  # the rotated queries (the keys and values go to the caches)
        out = torch.empty(
            rows, rope.heads * rope.head_dim, device=weight.device, dtype=rows_view.dtype
        )
    elif split == 1 or scratch is not None:
        out = torch.empty(rows, out_features, device=weight.device, dtype=rows_view.dtype)
    else:  # the splits add into a zeroed fp32 output, cast below
        out = torch.zeros(rows, out_features, device=weight.device, dtype=torch.float32)
    if config.programs_per_sm:
        blocks = min(blocks, config.programs_per_sm * _multiprocessors(weight.device))
    grid = (blocks, rows, split)
    pdl = config.pdl and _pdl_supported(weight.device)
    prefetch_l2 = (
        pdl
        and config.l2_prefetch
        and config.block_n <= 32 * config.num_warps
        and (in_features * weight.element_size()) % 16 == 0
        and weight.data_ptr() % 16 == 0
    )
    decode_gemv_kernel[grid](
        rows_view,
        residual if residual is not None else rows_view,
        norm_weight if norm_weight is not None else rows_view,
        total if total is not None else out,
        weight,
        bias if bias is not None else weight,
        out,
        scratch[0] if scratch is not None else out,
        scratch[1] if scratch is not None else out,
        out_features,
        in_features,
        rows_view.stride(0),
        out.stride(0),
        eps,
        *(rope.arguments() if rope is not None else (out, out, out, out, out, 0, 0, 0, 0)),
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        HAS_NORM_WEIGHT=norm_weight is not None,
        HAS_BIAS=bias is not None,
        EVEN_N=out_features % config.block_n == 0,
        EVEN_K=in_features % config.block_k == 0,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PREFETCH=config.prefetch,
        SPLIT_K=split,
        FIXUP=scratch is not None,
        EARLY=config.pdl or config.early,
        USE_GDC=pdl,
        NORM_BLOCK=min(triton.next_power_of_2(in_features), 1024 * config.num_warps),
        L2_PREFETCH=prefetch_l2,
        L2_BLOCKS=config.l2_prefetch_blocks,
        DEFER_NORM=prologue == NORM and config.defer_norm and split == 1,
        LATE_TRIGGER=config.late_trigger,
        ROPE=rope is not None,
        HEADS=rope.heads if rope is not None else 1,
        KV_HEADS=rope.kv_heads if rope is not None else 1,
        HEAD_DIM=rope.head_dim if rope is not None else 128,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out if out.dtype == rows_view.dtype else out.to(rows_view.dtype)


@dataclasses.dataclass
class _Rope:
    """What the ``ROPE`` epilogue needs: the token's rotary tables (one row per activation
    row), the caches, the slot and the head layout."""

    cos: torch.Tensor
    sin: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slots: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int

    def arguments(self) -> tuple[Any, ...]:
        cache = self.key_cache
        return (
            self.cos,
            self.sin,
            cache,
            self.value_cache,
            self.slots,
            self.cos.stride(0),
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: DecodeGemvConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.decode_gemv.reference.decode_gemv`; more than
    :data:`MAX_ROWS` rows or mixed dtypes run the reference (``F.linear``). ``pdl``: launch
    with programmatic dependent launch or not (None: as the launch table says)."""
    check_kernel_device("decode_gemv", x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if not _supported(rows, weight, x, x.shape[-1]) or _needs_grad(x, weight, bias):
        return reference_gemv(x, weight, bias)
    out = _launch(PLAIN, _rows(x), None, None, None, weight, bias, 0.0, config, pdl)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: DecodeGemvConfig | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`slipstream.kernels.ops.decode_gemv.reference.norm_gemv` (``pdl``: as for
    :func:`decode_gemv`)."""
    check_kernel_device("norm_gemv", x, residual, norm_weight, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        not _supported(rows, weight, x, x.shape[-1])
        or _needs_grad(x, residual, norm_weight, weight, bias)
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
        or (norm_weight is not None and norm_weight.shape != x.shape[-1:])
    ):
        return reference_norm(x, residual, norm_weight, eps, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    res = None if residual is None else residual.reshape(flat.shape).contiguous()
    total = torch.empty_like(flat) if res is not None else None
    out = _launch(NORM, flat, res, norm_weight, total, weight, bias, eps, config, pdl)
    return (
        x if total is None else total.view(x.shape),
        out.reshape(*x.shape[:-1], weight.shape[0]),
    )


def norm_gemv_rotary(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    config: DecodeGemvConfig | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`slipstream.kernels.ops.decode_gemv.reference.norm_gemv_rotary`: one launch
    where the launch says so (``fold_rotary``) and it can (one token per row, full-width
    rotary, ``block_n`` dividing ``head_dim``); else :func:`norm_gemv` then
    ``rotary_kv_write``."""
    check_kernel_device("norm_gemv_rotary", x, residual, norm_weight, weight, bias, cos, sin)
    check_kernel_device("norm_gemv_rotary", key_cache, value_cache, slots)
    batch, length, hidden = x.shape
    head_dim = key_cache.shape[-1]
    launch = config or launch_config(NORM, weight.shape[0], hidden, weight.device)
    if (
        not launch.fold_rotary
        or length != 1
        or cos is None
        or sin is None
        or cos.shape[-1] * 2 != head_dim
        or cos.dtype != sin.dtype
        or cos.shape[:2] != (batch, 1)
        or head_dim % launch.block_n
        or launch.block_n < 2
        or weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim
        or key_cache.stride() != value_cache.stride()
        or key_cache.stride(-1) != 1
        or tuple(key_cache.shape) != (batch, num_kv_heads, key_cache.shape[2], head_dim)
        or not _supported(batch, weight, x, hidden)
        or key_cache.dtype != x.dtype
        or _needs_grad(x, residual, norm_weight, weight, bias)
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
        or (norm_weight is not None and norm_weight.shape != x.shape[-1:])
    ):
        from slipstream.kernels.ops.rotary_kv_write import rotary_kv_write

        summed, qkv = norm_gemv(x, residual, norm_weight, eps, weight, bias, config, pdl)
        q = rotary_kv_write(
            qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads, pdl=bool(pdl)
        )
        return summed, q
    flat = x.reshape(batch, hidden).contiguous()
    res = None if residual is None else residual.reshape(flat.shape).contiguous()
    total = torch.empty_like(flat) if res is not None else None
    trig = cos.reshape(batch, -1), sin.reshape(batch, -1)
    rope = _Rope(
        trig[0] if trig[0].stride(-1) == 1 else trig[0].contiguous(),
        trig[1] if trig[1].stride(-1) == 1 else trig[1].contiguous(),
        key_cache,
        value_cache,
        slots,
        num_heads,
        num_kv_heads,
        head_dim,
    )
    q = _launch(NORM, flat, res, norm_weight, total, weight, bias, eps, launch, pdl, rope)
    return (
        x if total is None else total.view(x.shape),
        q.view(batch, num_heads, 1, head_dim),
    )


def gated_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: DecodeGemvConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.decode_gemv.reference.gated_gemv` (``pdl``: as for
    :func:`decode_gemv`)."""
    check_kernel_device("gated_gemv", gate_up, weight, bias)
    half = gate_up.shape[-1] // 2
    rows = gate_up.numel() // max(gate_up.shape[-1], 1)
    if (
        gate_up.shape[-1] % 2
        or not _supported(rows, weight, gate_up, half)
        or _needs_grad(gate_up, weight, bias)
    ):
        return reference_gated(gate_up, weight, bias)
    out = _launch(GATED, _rows(gate_up), None, None, None, weight, bias, 0.0, config, pdl)
    return out.reshape(*gate_up.shape[:-1], weight.shape[0])


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("bf16", "fp16"):
        for prologue in (PLAIN, NORM, GATED):
            specs.append(
                AotSpec(
                    f"decode_gemv.prologue{prologue}[{dtype}]",
                    decode_gemv_kernel,
                    {
                        "x_ptr": f"*{dtype}",
                        "r_ptr": f"*{dtype}",
                        "nw_ptr": f"*{dtype}",
                        "total_ptr": f"*{dtype}",
                        "w_ptr": f"*{dtype}",
                        "b_ptr": f"*{dtype}",
                        "y_ptr": f"*{dtype}",
                        "ws_ptr": "*fp32",
                        "count_ptr": "*i32",
                        "N": "i32",
                        "K": "i32",
                        "x_stride": "i32",
                        "y_stride": "i32",
                        "eps": "fp32",
                        "cos_ptr": "*fp32",
                        "sin_ptr": "*fp32",
                        "kc_ptr": f"*{dtype}",
                        "vc_ptr": f"*{dtype}",
                        "slots_ptr": "*i64",
                        "trig_stride": "i32",
                        "cache_sb": "i32",
                        "cache_sh": "i32",
                        "cache_ss": "i32",
                        "PROLOGUE": "constexpr",
                        "HAS_RESIDUAL": "constexpr",
                        "HAS_NORM_WEIGHT": "constexpr",
                        "HAS_BIAS": "constexpr",
                        "EVEN_N": "constexpr",
                        "EVEN_K": "constexpr",
                        "BLOCK_N": "constexpr",
                        "BLOCK_K": "constexpr",
                        "PREFETCH": "constexpr",
                        "SPLIT_K": "constexpr",
                        "FIXUP": "constexpr",
                        "EARLY": "constexpr",
                        "USE_GDC": "constexpr",
                        "NORM_BLOCK": "constexpr",
                        "L2_PREFETCH": "constexpr",
                        "L2_BLOCKS": "constexpr",
                        "DEFER_NORM": "constexpr",
                        "LATE_TRIGGER": "constexpr",
                        "ROPE": "constexpr",
                        "HEADS": "constexpr",
                        "KV_HEADS": "constexpr",
                        "HEAD_DIM": "constexpr",
                    },
                    {
                        "PROLOGUE": prologue,
                        "HAS_RESIDUAL": prologue == NORM,
                        "HAS_NORM_WEIGHT": prologue == NORM,
                        "HAS_BIAS": False,
                        "EVEN_N": True,
                        "EVEN_K": True,
                        "BLOCK_N": 8,
                        "BLOCK_K": 512,
                        "PREFETCH": False,
                        "SPLIT_K": 1,
                        "FIXUP": False,
                        "EARLY": False,
                        "USE_GDC": False,
                        "NORM_BLOCK": 4096,
                        "L2_PREFETCH": False,
                        "L2_BLOCKS": 0,
                        "DEFER_NORM": False,
                        "LATE_TRIGGER": False,
                        # QKV with rotary_kv_write in the epilogue (8B Llama heads)
                        "ROPE": prologue == NORM,
                        "HEADS": 32,
                        "KV_HEADS": 8,
                        "HEAD_DIM": 128,
                    },
                )
            )
    return specs
