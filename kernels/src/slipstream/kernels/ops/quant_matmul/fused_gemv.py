"""The packed int4 / int8 / fp8 decode GEMV with a decoder block's small ops folded in.

At batch-1 decode a quantized step spends about a third of its time outside the GEMVs: the
residual add + RMSNorm before QKV and gate/up, SiLU * up before down, each a launch of its own.
:func:`fused_quant_gemv` runs :mod:`.gemv`'s packed-weight loop (same layout, same f16x2
unpacking, same launch table) with three optional pieces around it, so that a Llama block needs
no kernel between its projections but the attention's:

- **add + norm epilogue** (``residual``, ``norm_weight``): the output projection (or down)
  writes, for its own ``block_n`` features, ``total = x + y`` (the residual stream, rounded as
  ``add_rms_norm`` rounds it), ``u = total * norm_weight`` (the next RMSNorm without its
  ``1 / rms``) as the output, and one fp32 partial sum of ``total**2`` per program. The row's
  RMS needs every feature, which no program has; the consumer finishes it.
- **norm prologue** (``stats``): the next GEMV (QKV, gate/up, head) reads the partial sums (a
  few KiB from L2), forms ``rstd = 1 / sqrt(mean(total**2) + eps)`` and multiplies its fp32
  accumulator by it: ``y = rstd * (W @ u)``, the same value as ``W @ rms_norm(total)`` with the
  norm's rounding moved from ``u * rstd`` to ``y``. In the f16x2 path the activations are
  scaled by the power of two nearest below ``rstd`` before their f16 conversion (exact), so a
  residual stream far from 1 keeps f16's precision and range.
- **SiLU * up epilogue** (``gated``): the weight is ``[gate; up]`` (``2I`` rows); program ``p``
  computes gate rows ``j`` and up rows ``I + j`` of the same ``block_n / 2`` features ``j`` and
  writes ``silu(gate) * up`` (``I`` outputs, rounded as ``gated_activation`` rounds).

Split-K (``FusedGemvConfig.split_k``) cuts a block's K range in parts, one program each: every
part leaves its fp32 sums in its own slice of a workspace, and the last part to arrive (an
arrival counter) adds the slices in part order, so the result is the same bits whichever part
finishes last, and runs the epilogue (which needs the block's whole rows). Scales are read in
their stored dtype (fp32, fp16 or bf16: ``quant.weight.scale_dtype``) and multiply in fp32. One
program per activation row, for a few rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.quant_matmul.fused_table import FusedGemvConfig, lookup_fused
from slipstream.kernels.ops.quant_matmul.gemv import (
    GEMV_FORMAT_CODES,
    GemvConfig,
    _fp32_step_sums,
    _half2_quad_dot,
    _half2_quad_sums,
    _multiprocessors,
    _split4,
    _split_k_sum,
    _x_half2,
    gemv_block_k,
    gemv_default_config,
    gemv_supports,
    half2_supported,
)
from slipstream.kernels.ops.quant_matmul.packing import PER_WORD, check_packable, is_packable
from slipstream.kernels.ops.quant_matmul.reference import (
    quant_decode_gemv as reference_decode_gemv,
)
from slipstream.kernels.ops.quant_matmul.reference import (
    quant_decode_qkv as reference_decode_qkv,
)
from slipstream.kernels.triton_support import AotSpec, check_kernel_device

__all__ = [
    "PDL_MODES",
    "FusedGemvConfig",
    "fused_config",
    "fused_config_supported",
    "fused_gemv_kernel",
    "fused_quant_gemv",
    "fused_quant_qkv",
    "fused_quant_supported",
]

MAX_ROWS = 4
STATS_BLOCK = 256
# The norm prologue reads the producer's partial sums in one pass of up to this many (one L2
# round trip before the first multiply-add, instead of one per 256).
STATS_BLOCK_MAX = 2048
# Programmatic dependent launch (NVIDIA sm_90+), the ``pdl`` argument (``init_inference``'s
# ``quant.weight.decode_pdl`` key): each launch may start while the kernel before it finishes,
# loading its first weight tile (weights are never written) and prefetching weight rows into
# L2, and waits (``griddepcontrol.wait``) before it reads activations or writes anything.
# "on": the L2 prefetch of weights that fit L2_PREFETCH_BYTES whole (an H200 decoded an 8B
# model 2.0% (int4) and 5.2% (int8) faster than with "off"); "l2_partial": also the first part
# of every row of larger weights (not measured yet); "off": plain launches.
PDL_MODES = ("on", "l2_partial", "off")

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # an older Triton: never launched with GDC=True
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        """Placeholder (this Triton has no grid dependency control)."""

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        """Placeholder (this Triton has no grid dependency control)."""


@triton.jit
def _x_half2_scaled(lo, hi, xscale):
    """``gemv._x_half2`` for bf16 pairs, each value times ``xscale`` (a power of two) in fp32
    before the f16 conversion: ``(lo.low, hi.low)`` and ``(lo.high, hi.high)`` as f16x2 (inline
    PTX: four fmuls more than the unscaled conversion)."""
    scale = (tl.zeros_like(lo).to(tl.float32) + xscale).to(tl.int32, bitcast=True)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 al, ah, bl, bh;
        .reg .f32 s, fal, fah, fbl, fbh;
        mov.b32 s, $4;
        shl.b32 al, $2, 16;
        and.b32 ah, $2, 0xffff0000;
        shl.b32 bl, $3, 16;
        and.b32 bh, $3, 0xffff0000;
        mov.b32 fal, al;
        mov.b32 fah, ah;
        mov.b32 fbl, bl;
        mov.b32 fbh, bh;
        mul.rn.f32 fal, fal, s;
        mul.rn.f32 fah, fah, s;
        mul.rn.f32 fbl, fbl, s;
        mul.rn.f32 fbh, fbh, s;
        cvt.rn.f16x2.f32 $0, fbl, fal;
        cvt.rn.f16x2.f32 $1, fbh, fah;
        }""",
        "=r,=r,r,r,r",
        [lo, hi, scale],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _l2_prefetch(rows, nbytes):
    """``cp.async.bulk.prefetch.L2`` of ``nbytes`` from each pointer of ``rows`` (sm_90)."""
    return tl.inline_asm_elementwise(
        """{
        cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r",
        [rows, nbytes],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _block_rows(
    blk,
    r,
    N,
    ROPE: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The weight rows of output block ``blk`` (rows past the end re-read the last one) and
    which of them are real."""
    if ROPE:
        # rotary pairs: weight rows (head, i) and (head, i + HEAD_DIM / 2) in one program
        pair = blk * (BLOCK_N // 2) + r // 2
        ok = pair < N // 2
        pair = tl.minimum(pair, N // 2 - 1)
        rows = (pair // (HEAD_DIM // 2)) * HEAD_DIM + pair % (HEAD_DIM // 2)
        rows = rows + (r % 2) * (HEAD_DIM // 2)
    elif GATED:
        # gate j, up j, gate j + 1, up j + 1, ...
        feature = blk * (BLOCK_N // 2) + r // 2
        ok = feature < N // 2
        rows = tl.minimum(feature, N // 2 - 1) + (r % 2) * (N // 2)
    else:
        rows = blk * BLOCK_N + r
        ok = rows < N
        rows = tl.minimum(rows, N - 1)
    return rows, ok


@triton.jit
def _x_step(pairs, k0, g, jj, FORMAT: tl.constexpr, PACK: tl.constexpr):
    """The activation pairs (int32, two 16-bit values each) of the K step at ``k0`` that
    :func:`_tile` loads for its f16x2 path: int4 reads four runs of 16, int8 two."""
    xpairs = pairs + k0 // 2 + g * (PACK // 2) + jj
    if FORMAT == 1:
        return tl.load(xpairs), tl.load(xpairs + 16), tl.load(xpairs + 32), tl.load(xpairs + 48)
    else:
        low = tl.load(xpairs)
        high = tl.load(xpairs + 16)
        return low, high, low, high


@triton.jit
def _tile_loaded(
    acc_quads, words, scale, x0, x1, x2, x3, xscale,
    FORMAT: tl.constexpr, NORM_IN: tl.constexpr, X_BF16: tl.constexpr,
):  # fmt: skip
    """:func:`_tile`'s f16x2 path with the step's activations already loaded
    (:func:`_x_step`, a step ahead: ``x_ahead``): the same products, the same bits."""
    quad_scale, _s1, _s2, _s3 = _split4(scale)
    if FORMAT == 1:
        lo_a, hi_a, lo_c, hi_c = x0, x2, x1, x3
    else:
        lo_a, hi_a, lo_c, hi_c = x0, x1, x0, x1
    if NORM_IN and X_BF16:
        xa, xb = _x_half2_scaled(lo_a, hi_a, xscale)
        xc, xd = _x_half2_scaled(lo_c, hi_c, xscale)
    else:
        xa, xb = _x_half2(lo_a, hi_a, X_BF16)
        xc, xd = _x_half2(lo_c, hi_c, X_BF16)
    sums = _half2_quad_dot(words, xa, xb, xc, xd, FORMAT)
    return acc_quads + sums * quad_scale.to(tl.float32)


@triton.jit
def _tile(
    acc3,
    acc_quads,
    words,
    scale,
    k0,
    x_row,
    pairs,
    g,
    jj,
    xscale,
    FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GPS: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    HALF2: tl.constexpr,
    NORM_IN: tl.constexpr,
):
    """One K step's products of the weight tile ``words`` / ``scale`` with the activations at
    ``k0``, added to the accumulators (f16x2 quads, or the fp32 path's per-word sums)."""
    x_type = x_row.dtype.element_ty
    PER: tl.constexpr = 8 if FORMAT == 1 else 4  # fields per word
    PACK: tl.constexpr = 16 * PER
    if HALF2:
        xpairs = pairs + k0 // 2 + g * (PACK // 2) + jj
        quad_scale, _s1, _s2, _s3 = _split4(scale)
        if NORM_IN and x_type == tl.bfloat16:
            if FORMAT == 1:
                xa, xb = _x_half2_scaled(tl.load(xpairs), tl.load(xpairs + 32), xscale)
                xc, xd = _x_half2_scaled(tl.load(xpairs + 16), tl.load(xpairs + 48), xscale)
            else:
                xa, xb = _x_half2_scaled(tl.load(xpairs), tl.load(xpairs + 16), xscale)
                xc, xd = xa, xb
            sums = _half2_quad_dot(words, xa, xb, xc, xd, FORMAT)
        else:
            sums = _half2_quad_sums(words, xpairs, FORMAT, x_type == tl.bfloat16)
        acc_quads += sums * quad_scale.to(tl.float32)
    else:
        t = _fp32_step_sums(words, x_row, pairs, k0, g, jj, FORMAT, BLOCK_N, GPS, NATIVE_FP8)
        acc3 += t * scale.to(tl.float32)
    return acc3, acc_quads


@triton.jit
def _rope_inputs(
    cos_ptr,
    sin_ptr,
    slot_ptr,
    pid_m,
    blk,
    N,
    heads,
    kv_heads,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """The QKV epilogue's inputs for block ``blk`` (``early_epilogue``): cos and sin of its
    rotary pairs (1 and 0 for values and past the end, which are not rotated) and the cache
    slot."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pr = blk * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    turn = (pr < N // 2) & (pr // HALF < heads + kv_heads)
    fi = pr % HALF
    c = tl.load(cos_ptr + pid_m * HALF + fi, mask=turn, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + pid_m * HALF + fi, mask=turn, other=0.0).to(tl.float32)
    return c, sn, tl.load(slot_ptr).to(tl.int64)


@triton.jit
def fused_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    stats_ptr,  # NORM_IN: (rows, n_stats) fp32 partial sums of squares of the normed row
    res_ptr,  # ADD_NORM: the residual (rows, N)
    nw_ptr,  # ADD_NORM: the next RMSNorm's weight (N,)
    total_ptr,  # ADD_NORM: out, the residual sum (rows, N)
    stats_out_ptr,  # ADD_NORM: out, (rows, programs) partial sums of total**2
    N,
    K,
    stride_xm,
    stride_om,
    stride_cn,
    n_stats,
    eps,
    prefetch_bytes,  # L2_PREFETCH: bytes of each code row prefetched (a multiple of 16)
    cos_ptr,  # ROPE: (rows, HEAD_DIM / 2) fp32 rotary tables
    sin_ptr,
    slot_ptr,  # ROPE: the cache slot of the token
    key_ptr,  # ROPE: the layer's key / value cache (rows, kv_heads, slots, HEAD_DIM)
    value_ptr,
    heads,
    kv_heads,
    cache_sb,
    cache_sh,
    cache_ss,
    ws_ptr,  # SPLIT_K > 1: fp32 (SPLIT_K, rows, N) partial sums, zero at rest
    count_ptr,  # SPLIT_K > 1: int32 arrival counters per (row, block), zero at rest
    FORMAT: tl.constexpr,  # 0 int8, 1 int4, 2 fp8 e4m3 (packed words)
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    HALF2: tl.constexpr,  # int4/int8, 16-bit x, NVIDIA: f16x2 quads (gemv's QUADS path)
    PREFETCH: tl.constexpr,
    NORM_IN: tl.constexpr,
    GATED: tl.constexpr,
    ADD_NORM: tl.constexpr,
    STATS: tl.constexpr,
    ROPE: tl.constexpr = False,  # QKV: rotate q and k, write q to out and k, v to the cache
    HEAD_DIM: tl.constexpr = 128,
    GDC: tl.constexpr = False,  # launched with PDL: wait for the previous kernel (PDL_MODES)
    L2_PREFETCH: tl.constexpr = False,  # GDC: the program's weight rows into L2 before the wait
    SPLIT_K: tl.constexpr = 1,  # K ranges per block, one program each (program_id 2)
    PERSISTENT: tl.constexpr = True,  # programs may walk several blocks (False: one each)
    TWO_STEP: tl.constexpr = False,  # PREFETCH: the two-step loop (FusedGemvConfig.two_step)
    EARLY_EPILOGUE: tl.constexpr = False,  # the epilogue's inputs loaded before the K loop
    X_AHEAD: tl.constexpr = False,  # HALF2 + PREFETCH: each step's activations a step ahead
    LATE_TRIGGER: tl.constexpr = False,  # GDC: the next kernel may launch after the wait only
):
    """One activation row per program ``(row, p)``; see the module docstring for the pieces."""
    if GDC and not LATE_TRIGGER:
        gdc_launch_dependents()  # the next fused GEMV may be scheduled behind this one
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    programs = tl.num_programs(1)
    r = tl.arange(0, BLOCK_N)
    if ROPE or GATED:
        n_blocks = tl.cdiv(N // 2, BLOCK_N // 2)
    else:
        n_blocks = tl.cdiv(N, BLOCK_N)
    steps = K // BLOCK_K
    # this program's K range (split-K: a contiguous share of the steps)
    per_split = tl.cdiv(steps, SPLIT_K)
    k_first = tl.program_id(2) * per_split
    k_last = tl.minimum(k_first + per_split, steps)
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    x_type = x_ptr.dtype.element_ty
    out_type = out_ptr.dtype.element_ty
    PER: tl.constexpr = 8 if FORMAT == 1 else 4  # fields per word
    PACK: tl.constexpr = 16 * PER  # input features per packed block
    GPS: tl.constexpr = BLOCK_K // PACK  # packed blocks per step
    g = tl.arange(0, GPS)[None, :, None]
    jj = tl.arange(0, 16)[None, None, :]
    word = g * 16 + jj
    pairs = x_row.to(tl.pointer_type(tl.int32), bitcast=True)
    cols, col_ok = _block_rows(pid_n, r, N, ROPE, GATED, BLOCK_N, HEAD_DIM)
    if PREFETCH:  # the first block's first tile
        first_rows = cols.to(tl.int64)[:, None, None]
        next_words = tl.load(codes_ptr + first_rows * stride_cn + k_first * (BLOCK_K // PER) + word)
        next_scale = tl.load(
            scales_ptr
            + first_rows * (K // GROUP)
            + (k_first * BLOCK_K + g * PACK) // GROUP
            + jj * 0
        )
    if GDC:  # the weights are ours to read early; everything else waits for the producer
        if L2_PREFETCH:
            # the first prefetch_bytes of each of the program's code rows (contiguous) in one
            # bulk L2 prefetch (sm_90): the weight streams while the previous kernel finishes
            _l2_prefetch(codes_ptr + cols.to(tl.int64) * stride_cn, r * 0 + prefetch_bytes)
        gdc_wait()
        if LATE_TRIGGER:
            gdc_launch_dependents()
    # the norm's statistics while the first weight tile is in flight
    rstd = 1.0
    xscale = 1.0
    if NORM_IN:
        s = tl.zeros((STATS,), dtype=tl.float32)
        for i in range(0, n_stats, STATS):
            idx = i + tl.arange(0, STATS)
            s += tl.load(stats_ptr + pid_m * n_stats + idx, mask=idx < n_stats, other=0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(s, axis=0) / K + eps)
        if HALF2 and x_type == tl.bfloat16:
            # the power of two at or below rstd: scaling by it is exact
            xscale = (rstd.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    # Program p computes blocks p, p + P, ... (one block each unless the grid is persistent:
    # then the statistics above are read once for several blocks).
    for blk in range(pid_n, n_blocks, programs):
        cols, col_ok = _block_rows(blk, r, N, ROPE, GATED, BLOCK_N, HEAD_DIM)
        following, _ok = _block_rows(
            tl.minimum(blk + programs, n_blocks - 1), r, N, ROPE, GATED, BLOCK_N, HEAD_DIM
        )
        safe_rows = cols.to(tl.int64)[:, None, None]
        code_rows = codes_ptr + safe_rows * stride_cn
        scale_rows = scales_ptr + safe_rows * (K // GROUP) + jj * 0
        # (the block's tile pointers once: a step only adds its offset)
        code_tile = code_rows + word
        acc3 = tl.zeros((BLOCK_N, GPS, 16), dtype=tl.float32)
        acc_quads = tl.zeros((BLOCK_N, GPS, 4), dtype=tl.float32)
        if EARLY_EPILOGUE:  # in flight during the K loop (they are read after the wait)
            if ROPE:
                early_c, early_s, early_slot = _rope_inputs(
                    cos_ptr, sin_ptr, slot_ptr, pid_m, blk, N, heads, kv_heads, BLOCK_N, HEAD_DIM
                )
            elif ADD_NORM:
                early_row = pid_m.to(tl.int64) * N
                early_res = tl.load(res_ptr + early_row + cols, mask=col_ok, other=0.0)
                early_nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0)
        if X_AHEAD:  # the first step's activations (the K loop loads the next ones ahead)
            nx0, nx1, nx2, nx3 = _x_step(pairs, k_first * BLOCK_K, g, jj, FORMAT, PACK)
        if PREFETCH and TWO_STEP:
            # Two steps an iteration, each tile loaded one step ahead of its use: the second
            # step's tile while the first computes, the next iteration's first tile while the
            # second computes (into the registers the first just freed: no copies between
            # the prefetch buffer and the tile in use). Past the end the last tile is re-read.
            for step in range(k_first, k_last, 2):
                second = tl.minimum(step + 1, k_last - 1)
                words = tl.load(code_tile + second * (BLOCK_K // PER))
                scale = tl.load(scale_rows + (second * BLOCK_K + g * PACK) // GROUP)
                if X_AHEAD:
                    sx0, sx1, sx2, sx3 = _x_step(pairs, second * BLOCK_K, g, jj, FORMAT, PACK)
                    acc_quads = _tile_loaded(
                        acc_quads, next_words, next_scale, nx0, nx1, nx2, nx3, xscale,
                        FORMAT, NORM_IN, x_type == tl.bfloat16,
                    )  # fmt: skip
                else:
                    acc3, acc_quads = _tile(
                        acc3, acc_quads, next_words, next_scale, step * BLOCK_K, x_row, pairs,
                        g, jj, xscale, FORMAT, BLOCK_N, GPS, NATIVE_FP8, HALF2, NORM_IN,
                    )  # fmt: skip
                ahead = tl.minimum(step + 2, k_last - 1)
                next_words = tl.load(code_tile + ahead * (BLOCK_K // PER))
                next_scale = tl.load(scale_rows + (ahead * BLOCK_K + g * PACK) // GROUP)
                if X_AHEAD:
                    nx0, nx1, nx2, nx3 = _x_step(pairs, ahead * BLOCK_K, g, jj, FORMAT, PACK)
                if step + 1 < k_last:
                    if X_AHEAD:
                        acc_quads = _tile_loaded(
                            acc_quads, words, scale, sx0, sx1, sx2, sx3, xscale,
                            FORMAT, NORM_IN, x_type == tl.bfloat16,
                        )  # fmt: skip
                    else:
                        acc3, acc_quads = _tile(
                            acc3, acc_quads, words, scale, second * BLOCK_K, x_row, pairs,
                            g, jj, xscale, FORMAT, BLOCK_N, GPS, NATIVE_FP8, HALF2, NORM_IN,
                        )  # fmt: skip
            if PERSISTENT:  # the next block's first tile, in flight during the epilogue
                next_rows = following.to(tl.int64)[:, None, None]
                next_words = tl.load(
                    codes_ptr + next_rows * stride_cn + k_first * (BLOCK_K // PER) + word
                )
                next_scale = tl.load(
                    scales_ptr
                    + next_rows * (K // GROUP)
                    + (k_first * BLOCK_K + g * PACK) // GROUP
                    + jj * 0
                )
        else:
            for step in range(k_first, k_last):
                k0 = step * BLOCK_K
                if PREFETCH:
                    words = next_words
                    scale = next_scale
                    if X_AHEAD:
                        cx0, cx1, cx2, cx3 = nx0, nx1, nx2, nx3
                    # the next step's tile, or after the last step the next block's first tile
                    # (its rows gathered again each step: fewer registers than TWO_STEP's
                    # tile pointers, more instructions)
                    more = step + 1 < k_last
                    ahead = tl.where(more, step + 1, k_first)
                    ahead_rows = tl.where(more, cols, following).to(tl.int64)[:, None, None]
                    next_words = tl.load(
                        codes_ptr + ahead_rows * stride_cn + ahead * (BLOCK_K // PER) + word
                    )
                    next_scale = tl.load(
                        scales_ptr
                        + ahead_rows * (K // GROUP)
                        + (ahead * BLOCK_K + g * PACK) // GROUP
                        + jj * 0
                    )
                    if X_AHEAD:
                        nx0, nx1, nx2, nx3 = _x_step(pairs, ahead * BLOCK_K, g, jj, FORMAT, PACK)
                else:
                    words = tl.load(code_tile + step * (BLOCK_K // PER))
                    scale = tl.load(scale_rows + (k0 + g * PACK) // GROUP)
                if X_AHEAD:
                    acc_quads = _tile_loaded(
                        acc_quads, words, scale, cx0, cx1, cx2, cx3, xscale,
                        FORMAT, NORM_IN, x_type == tl.bfloat16,
                    )  # fmt: skip
                else:
                    acc3, acc_quads = _tile(
                        acc3, acc_quads, words, scale, k0, x_row, pairs, g, jj, xscale,
                        FORMAT, BLOCK_N, GPS, NATIVE_FP8, HALF2, NORM_IN,
                    )  # fmt: skip
        if HALF2:
            acc = tl.sum(tl.sum(acc_quads, axis=2), axis=1) * (128.0 if FORMAT == 1 else 1024.0)
        else:
            acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
            if FORMAT == 2 and not NATIVE_FP8:
                acc = acc * 256.0
        if NORM_IN:
            acc = acc * (rstd / xscale)
        done = True
        if SPLIT_K > 1:
            # the splits' sums added in a fixed order by the last to arrive (_split_k_sum),
            # which runs the epilogue for the block
            counter = count_ptr + pid_m * n_blocks + blk
            acc, done = _split_k_sum(
                acc, ws_ptr, counter, tl.program_id(2), pid_m, N, cols, col_ok, SPLIT_K
            )
        if done:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols).to(tl.float32)
            out_row = out_ptr + pid_m.to(tl.int64) * stride_om
            if ROPE:
                # the outputs rounded as the unfused GEMV's, then rotary_kv_write's math
                HALF: tl.constexpr = HEAD_DIM // 2
                y = acc.to(out_type).to(tl.float32)
                first, second = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
                pr = blk * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                ok = pr < N // 2
                head = pr // HALF
                fi = pr % HALF
                is_q = head < heads
                is_v = head >= heads + kv_heads
                if EARLY_EPILOGUE:
                    c, sn = early_c, early_s
                else:
                    turn = ok & (head < heads + kv_heads)
                    c = tl.load(cos_ptr + pid_m * HALF + fi, mask=turn, other=1.0).to(tl.float32)
                    sn = tl.load(sin_ptr + pid_m * HALF + fi, mask=turn, other=0.0).to(tl.float32)
                # explicit fmas: every build rounds the same way (a plain a * b - c * d leaves
                # the contraction to the compiler, which may fuse either product, or neither,
                # differently in two specialisations: an ulp apart in fp32)
                lo = tl.fma(first, c, -(second * sn)).to(out_type)
                hi = tl.fma(second, c, first * sn).to(out_type)
                q_at = out_row + head * HEAD_DIM + fi
                tl.store(q_at, lo, mask=ok & is_q)
                tl.store(q_at + HALF, hi, mask=ok & is_q)
                if EARLY_EPILOGUE:
                    slot = early_slot
                else:
                    slot = tl.load(slot_ptr).to(tl.int64)
                kv = tl.where(is_v, head - heads - kv_heads, head - heads)
                at = pid_m.to(tl.int64) * cache_sb + kv * cache_sh + slot * cache_ss + fi
                k_ok = ok & (head >= heads) & ~is_v
                v_ok = ok & is_v
                tl.store(key_ptr + at, lo.to(key_ptr.dtype.element_ty), mask=k_ok)
                tl.store(key_ptr + at + HALF, hi.to(key_ptr.dtype.element_ty), mask=k_ok)
                tl.store(value_ptr + at, lo.to(value_ptr.dtype.element_ty), mask=v_ok)
                tl.store(value_ptr + at + HALF, hi.to(value_ptr.dtype.element_ty), mask=v_ok)
            elif GATED:
                # the outputs rounded as the unfused GEMV's, then gated_activation's math
                y = acc.to(out_type).to(tl.float32)
                gate, up = tl.split(tl.reshape(y, (BLOCK_N // 2, 2)))
                act = (gate / (1.0 + tl.exp(-gate))).to(out_type).to(tl.float32)
                j = blk * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                tl.store(out_row + j, (act * up).to(out_type), mask=j < N // 2)
            elif ADD_NORM:
                y = acc.to(out_type).to(tl.float32)
                row_n = pid_m.to(tl.int64) * N
                if EARLY_EPILOGUE:
                    res = early_res.to(tl.float32)
                else:
                    res = tl.load(res_ptr + row_n + cols, mask=col_ok, other=0.0).to(tl.float32)
                total = (y + res).to(total_ptr.dtype.element_ty)
                tl.store(total_ptr + row_n + cols, total, mask=col_ok)
                tf = tl.where(col_ok, total.to(tl.float32), 0.0)
                tl.store(stats_out_ptr + pid_m * n_blocks + blk, tl.sum(tf * tf, axis=0))
                if EARLY_EPILOGUE:
                    nw = early_nw.to(tl.float32)
                else:
                    nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                tl.store(out_row + cols, (tf * nw).to(out_type), mask=col_ok)
            else:
                tl.store(out_row + cols, acc.to(out_type), mask=col_ok)


def _native_fp8(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _pdl(device: torch.device, mode: str) -> dict[str, bool]:
    """The launch options for ``mode`` (:data:`PDL_MODES`) on this device (none where it
    cannot run: AMD, before sm_90, a Triton without grid dependency control)."""
    if mode not in PDL_MODES:
        raise ValueError(f"fused quantized GEMV: pdl = {mode!r}, expected one of {PDL_MODES}")
    if mode == "off" or not (_HAS_GDC and device.type == "cuda" and torch.version.hip is None):
        return {}
    if torch.cuda.get_device_capability(device) < (9, 0):
        return {}
    return {"GDC": True, "launch_pdl": True}


# With PDL, up to this many bytes of each weight are prefetched into L2 before the wait (a
# quarter of an H100's L2): all of an 8B model's QKV and output projection, the first part of
# every row of gate/up and down.
L2_PREFETCH_BYTES = 12 << 20


def _prefetch_bytes(out_features: int, row_bytes: int, partial: bool) -> int:
    """Bytes of each code row to prefetch into L2 (0: none, too few to be worth it);
    ``partial``: also the first part of the rows of a weight larger than the budget."""
    share = min(row_bytes, L2_PREFETCH_BYTES // max(out_features, 1)) // 16 * 16
    if share < row_bytes and not partial:
        return 0
    return share if share >= 256 else 0


def fused_quant_supported(format: str, group_size: int, in_features: int) -> bool:
    """Whether :func:`fused_quant_gemv` takes a packed weight of this format and shape."""
    if format not in PER_WORD:
        return False
    try:
        check_packable(format, group_size, in_features)
    except ValueError:
        return False
    return True


def _default_config(
    format: str,
    out_features: int,
    in_features: int,
    group_size: int,
    device: torch.device,
    fusion: str,
) -> FusedGemvConfig | None:
    """The rule: ``gemv_default_config``'s tile (the unfused sweep's table) in one K range,
    f16x2 where it runs, two rows at least for the paired epilogues, and with the norm
    prologue the first weight tile loaded before the statistics (its latency hidden)."""
    config = gemv_default_config(format, out_features, in_features, group_size, device)
    if config is None:
        return None
    paired = fusion in ("qkv", "gate_up")
    return FusedGemvConfig(
        block_n=max(config.block_n, 2) if paired else config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        half2=config.half2,
        prefetch=config.prefetch or fusion in ("qkv", "gate_up", "norm"),
    )


def fused_config_supported(
    format: str, group_size: int, in_features: int, fusion: str, config: FusedGemvConfig
) -> bool:
    """Whether ``config`` can launch a packed ``format`` weight of ``in_features`` inputs for
    ``fusion`` (a K step dividing the input, at least one step per K range, paired rows)."""
    if not gemv_supports(format, group_size, in_features, _as_gemv(config)):
        return False
    steps = in_features // gemv_block_k(format, config.num_warps)
    block_n = config.block_n
    return (
        block_n >= (2 if fusion in ("qkv", "gate_up") else 1)
        and block_n & (block_n - 1) == 0
        and 1 <= config.split_k <= steps
        and config.programs_per_sm >= 0
    )


def _as_gemv(config: FusedGemvConfig) -> GemvConfig:
    return GemvConfig(block_n=config.block_n, num_warps=config.num_warps)


def fused_config(
    format: str,
    fusion: str,
    out_features: int,
    in_features: int,
    group_size: int,
    device: torch.device,
) -> FusedGemvConfig | None:
    """The launch of one fused GEMV (None: the kernel cannot run it): the launch table's entry
    (user, then built-in; :mod:`.fused_table`) when it can run the shape, else the rule."""
    found = lookup_fused(format, fusion, out_features, in_features, device)
    if found is not None and fused_config_supported(
        format, group_size, in_features, fusion, found[0]
    ):
        return found[0]
    config = _default_config(format, out_features, in_features, group_size, device, fusion)
    if config is None or not fused_config_supported(
        format, group_size, in_features, fusion, config
    ):
        return None
    return config


def _fusion(gated: bool, add_norm: bool, norm_in: bool) -> str:
    """The launch table's name (``fused_table.FUSIONS``) of what a launch folds in."""
    if gated:
        return "gate_up"
    if add_norm:
        return "add_norm"
    return "norm" if norm_in else "plain"


def _check_config(
    format: str, group_size: int, in_features: int, fusion: str, config: FusedGemvConfig
) -> None:
    check_packable(format, group_size, in_features)
    if not fused_config_supported(format, group_size, in_features, fusion, config):
        raise ValueError(
            f"fused quantized GEMV: {config} cannot run {format} ({fusion}) with "
            f"in_features={in_features}: block_n a power of two (2+ for qkv / gate_up), "
            f"in_features a multiple of {gemv_block_k(format, config.num_warps)}, split_k at "
            f"most {in_features // gemv_block_k(format, config.num_warps)}"
        )


def fused_quant_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    config: FusedGemvConfig | None = None,
    pdl: str = "on",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """See :func:`slipstream.kernels.ops.quant_matmul.reference.quant_decode_gemv`: returns
    ``(out, total, stats_out)`` (the last two None without ``residual``). ``config``: this
    launch instead of :func:`fused_config`'s (benchmarks sweep it; ValueError if it cannot run
    the shape). ``pdl``: programmatic dependent launch, one of :data:`PDL_MODES`."""
    check_kernel_device("quant_decode_gemv", x, words, scales, bias, stats, residual, norm_weight)
    in_features = x.shape[-1]
    check_packable(format, group_size, in_features)
    out_features = words.numel() * PER_WORD[format] // in_features
    rows = x.numel() // max(in_features, 1)
    add_norm = residual is not None
    if gated and (out_features % 2 or add_norm):
        raise ValueError("fused_quant_gemv: gated needs an even [gate; up] weight, no residual")
    if add_norm and norm_weight is None:
        raise ValueError("fused_quant_gemv: residual needs norm_weight")
    fusion = _fusion(gated, add_norm, stats is not None)
    if config is not None:
        _check_config(format, group_size, in_features, fusion, config)
    else:
        config = fused_config(format, fusion, out_features, in_features, group_size, x.device)
    if not 0 < rows <= MAX_ROWS or (torch.is_grad_enabled() and x.requires_grad) or config is None:
        # more rows, autograd, or a shape the packed loop cannot step through: the reference
        return reference_decode_gemv(
            x, words, scales, format, group_size, bias, stats, eps, gated, residual, norm_weight
        )
    flat = x.reshape(rows, in_features)
    if flat.stride(-1) != 1 or flat.stride(0) % 2 or flat.data_ptr() % 4:
        flat = flat.clone(memory_format=torch.contiguous_format)
    width = out_features // 2 if gated else out_features
    out = torch.empty(rows, width, device=x.device, dtype=x.dtype)
    blocks = triton.cdiv(width, config.block_n // 2 if gated else config.block_n)
    total = stats_out = None
    if add_norm:
        assert residual is not None and norm_weight is not None
        if residual.numel() != rows * out_features:
            raise ValueError(
                f"fused_quant_gemv: residual has {residual.numel()} elements, expected "
                f"{rows} x {out_features}"
            )
        residual = residual.reshape(rows, out_features).contiguous()
        total = torch.empty_like(residual)
        stats_out = torch.empty(rows, blocks, device=x.device, dtype=torch.float32)
    if stats is not None:
        stats = stats.reshape(rows, -1).float().contiguous()
    _launch(
        (rows, blocks),
        flat,
        words,
        scales,
        bias,
        out,
        stats,
        residual,
        norm_weight,
        total,
        stats_out,
        format,
        group_size,
        eps,
        config,
        gated=gated,
        pdl_mode=pdl,
    )
    shape = x.shape[:-1]
    return (
        out.reshape(*shape, width),
        None if total is None else total.reshape(*shape, out_features),
        stats_out,
    )


def fused_quant_qkv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None,
    stats: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    config: FusedGemvConfig | None = None,
    pdl: str = "on",
) -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.quant_matmul.reference.quant_decode_qkv`: the QKV
    projection with ``rotary_kv_write`` in its epilogue (one token, full-width rotary).
    ``config``: this launch instead of :func:`fused_config`'s (ValueError if it cannot run);
    ``pdl``: programmatic dependent launch, one of :data:`PDL_MODES`."""
    check_kernel_device(
        "quant_decode_qkv", x, words, scales, bias, stats, cos, sin, key_cache, value_cache, slots
    )
    in_features = x.shape[-1]
    rows = x.numel() // max(in_features, 1)
    head_dim = key_cache.shape[-1]
    out_features = words.numel() * PER_WORD[format] // max(in_features, 1)
    if config is not None:
        _check_config(format, group_size, in_features, "qkv", config)
    elif is_packable(format, group_size, in_features):
        config = fused_config(format, "qkv", out_features, in_features, group_size, x.device)
    if (
        config is None
        or x.dim() != 3
        or x.shape[1] != 1
        or not 0 < rows <= MAX_ROWS
        or (torch.is_grad_enabled() and x.requires_grad)
        or cos is None
        or sin is None
        or 2 * cos.shape[-1] != head_dim
        or slots.numel() != 1
        or out_features != (num_heads + 2 * num_kv_heads) * head_dim
        or key_cache.stride() != value_cache.stride()
        or key_cache.stride(-1) != 1
        or key_cache.dtype != value_cache.dtype
    ):
        return reference_decode_qkv(
            x,
            words,
            scales,
            format,
            group_size,
            bias,
            stats,
            eps,
            cos,
            sin,
            key_cache,
            value_cache,
            slots,
            num_heads,
            num_kv_heads,
        )
    flat = x.reshape(rows, in_features)
    if flat.stride(-1) != 1 or flat.stride(0) % 2 or flat.data_ptr() % 4:
        flat = flat.clone(memory_format=torch.contiguous_format)
    if stats is not None:
        stats = stats.reshape(rows, -1).float().contiguous()
    out = torch.empty(rows, num_heads * head_dim, device=x.device, dtype=x.dtype)
    tables = (
        cos.reshape(rows, -1).float().contiguous(),
        sin.reshape(rows, -1).float().contiguous(),
    )
    _launch(
        (rows, triton.cdiv(out_features // 2, config.block_n // 2)),
        flat,
        words,
        scales,
        bias,
        out,
        stats,
        None,
        None,
        None,
        None,
        format,
        group_size,
        eps,
        config,
        rope=(*tables, slots, key_cache, value_cache),
        rope_shape=(num_heads, num_kv_heads, head_dim),
        pdl_mode=pdl,
    )
    return out.view(rows, num_heads, 1, head_dim)


# Weights with at least this many output blocks per SM (an 8B LM head's 32K blocks: 243 per
# SM of an H100; the block projections have at most 54) run a persistent grid of about
# PERSISTENT_PROGRAMS_PER_SM programs per SM, so the norm statistics are read once per program
# rather than once per block.
PERSISTENT_BLOCKS_PER_SM = 128
PERSISTENT_PROGRAMS_PER_SM = 16


def _stats_block(n_stats: int, one_pass: bool) -> int:
    """Partial sums the norm prologue loads per pass: STATS_BLOCK, or (``one_pass``) all of
    them, up to STATS_BLOCK_MAX."""
    if not one_pass:
        return STATS_BLOCK
    return max(STATS_BLOCK, min(triton.next_power_of_2(max(n_stats, 1)), STATS_BLOCK_MAX))


def _grid_programs(blocks: int, device: torch.device, programs_per_sm: int = 0) -> int:
    """Programs along the output blocks: one per block, or a persistent grid in which every
    program walks the same number of blocks (the last one fewer): ``programs_per_sm`` per SM,
    or with 0 the rule above."""
    sms = _multiprocessors(device)
    if programs_per_sm == 0:
        if blocks < PERSISTENT_BLOCKS_PER_SM * sms:
            return blocks
        programs_per_sm = PERSISTENT_PROGRAMS_PER_SM
    per_program = triton.cdiv(blocks, programs_per_sm * sms)
    return triton.cdiv(blocks, per_program)


# Split-K scratch per (device, stream): an fp32 workspace (a slice per split: the sums are added
# in split order, so a launch's result does not depend on which split finishes last) and arrival
# counters that the kernel leaves zeroed (a CUDA graph captured on the stream of its warm-up replays them as they are).
_SCRATCH: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(
    device: torch.device, values: int, counters: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The zeroed workspace and counters of a split launch, grown outside CUDA-graph capture
    only (None while capturing without a large enough one: the launch runs unsplit)."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device, stream)
    held = _SCRATCH.get(key)
    if held is not None and held[0].numel() >= values and held[1].numel() >= counters:
        return held
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    held = (
        torch.zeros(max(values, 1 << 16), device=device, dtype=torch.float32),
        torch.zeros(max(counters, 1 << 12), device=device, dtype=torch.int32),
    )
    _SCRATCH[key] = held
    return held


def _launch(
    grid: tuple[int, int],
    flat: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    stats: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    total: torch.Tensor | None,
    stats_out: torch.Tensor | None,
    format: str,
    group_size: int,
    eps: float,
    config: FusedGemvConfig,
    gated: bool = False,
    rope: tuple[torch.Tensor, ...] | None = None,
    rope_shape: tuple[int, int, int] = (0, 0, 128),
    pdl_mode: str = "on",
) -> None:
    in_features = flat.shape[-1]
    out_features = words.numel() * PER_WORD[format] // in_features
    pdl = _pdl(flat.device, pdl_mode)
    row_bytes = in_features * 4 // PER_WORD[format]
    prefetch = 0
    if pdl and config.l2_prefetch:
        prefetch = _prefetch_bytes(out_features, row_bytes, pdl_mode == "l2_partial")
    cos, sin, slots, key_cache, value_cache = rope if rope is not None else (out,) * 5
    cache_strides = key_cache.stride()[:3] if rope is not None else (0, 0, 0)
    blocks = grid[1]
    split = config.split_k
    scratch = None
    if split > 1:
        scratch = _split_scratch(flat.device, split * grid[0] * out_features, grid[0] * blocks)
        if scratch is None:
            split = 1
        else:
            prefetch = 0  # the L2 prefetch covers the start of each row: one K range's
    programs = _grid_programs(blocks, flat.device, config.programs_per_sm)
    persistent = programs < blocks
    half2 = config.half2 and half2_supported(format, flat)
    fused_gemv_kernel[(grid[0], programs, split)](
        flat,
        words,
        scales,
        bias if bias is not None else flat,
        out,
        stats if stats is not None else out,
        residual if residual is not None else out,
        norm_weight if norm_weight is not None else out,
        total if total is not None else out,
        stats_out if stats_out is not None else out,
        out_features,
        in_features,
        flat.stride(0),
        out.stride(0),
        in_features // PER_WORD[format],
        stats.shape[1] if stats is not None else 0,
        eps,
        prefetch,
        cos,
        sin,
        slots,
        key_cache,
        value_cache,
        rope_shape[0],
        rope_shape[1],
        *cache_strides,
        scratch[0] if scratch is not None else out,
        scratch[1] if scratch is not None else out,
        FORMAT=GEMV_FORMAT_CODES[format],
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=gemv_block_k(format, config.num_warps),
        NATIVE_FP8=format == "fp8_e4m3" and _native_fp8(flat.device),
        HALF2=half2,
        PREFETCH=config.prefetch,
        NORM_IN=stats is not None,
        GATED=gated,
        ADD_NORM=residual is not None,
        STATS=_stats_block(
            stats.shape[1] if stats is not None else 0, config.two_step or config.stats_one_pass
        ),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        L2_PREFETCH=prefetch > 0,
        SPLIT_K=split,
        PERSISTENT=persistent,
        TWO_STEP=config.two_step,
        EARLY_EPILOGUE=config.early_epilogue,
        X_AHEAD=config.x_ahead and config.prefetch and half2,
        LATE_TRIGGER=config.late_trigger and bool(pdl),
        ROPE=rope is not None,
        HEAD_DIM=rope_shape[2],
        **pdl,
    )


def aot_specs(half2: bool = False) -> list[AotSpec]:
    """The fused specialisations of a Llama decode step (bf16, 1-warp int4 / int8 steps): the
    norm-prologue + SwiGLU-epilogue gate/up, the add + norm epilogue, the norm-prologue QKV.
    ``half2``: the f16x2 PTX path (NVIDIA targets only)."""
    signature = {
        "x_ptr": "*bf16",
        "codes_ptr": "*i32",
        "scales_ptr": "*fp16",  # quant.weight.scale_dtype's default
        "bias_ptr": "*bf16",
        "out_ptr": "*bf16",
        "stats_ptr": "*fp32",
        "res_ptr": "*bf16",
        "nw_ptr": "*bf16",
        "total_ptr": "*bf16",
        "stats_out_ptr": "*fp32",
        "N": "i32",
        "K": "i32",
        "stride_xm": "i32",
        "stride_om": "i32",
        "stride_cn": "i32",
        "n_stats": "i32",
        "eps": "fp32",
        "prefetch_bytes": "i32",
        "cos_ptr": "*fp32",
        "sin_ptr": "*fp32",
        "slot_ptr": "*i64",
        "key_ptr": "*bf16",
        "value_ptr": "*bf16",
        "heads": "i32",
        "kv_heads": "i32",
        "cache_sb": "i32",
        "cache_sh": "i32",
        "cache_ss": "i32",
        "ws_ptr": "*fp32",
        "count_ptr": "*i32",
        **{
            name: "constexpr"
            for name in (
                "FORMAT",
                "GROUP",
                "HAS_BIAS",
                "BLOCK_N",
                "BLOCK_K",
                "NATIVE_FP8",
                "HALF2",
                "PREFETCH",
                "NORM_IN",
                "GATED",
                "ADD_NORM",
                "STATS",
                "ROPE",
                "HEAD_DIM",
                "GDC",
                "L2_PREFETCH",
                "SPLIT_K",
                "PERSISTENT",
                "TWO_STEP",
                "EARLY_EPILOGUE",
                "X_AHEAD",
                "LATE_TRIGGER",
            )
        },
    }
    specs = []
    for format in ("int4", "int8"):
        for norm_in, gated, add_norm, rope in (
            (True, True, False, False),
            (False, False, True, False),
            (True, False, False, True),
        ):
            constexprs = {
                "FORMAT": GEMV_FORMAT_CODES[format],
                "GROUP": 128,
                "HAS_BIAS": False,
                "BLOCK_N": 8 if gated else 4,  # (rope: two rotary pairs)
                "BLOCK_K": gemv_block_k(format, 1),
                "NATIVE_FP8": False,
                "HALF2": half2,
                "PREFETCH": True,
                "NORM_IN": norm_in,
                "GATED": gated,
                "ADD_NORM": add_norm,
                "STATS": STATS_BLOCK,
                "ROPE": rope,
                "HEAD_DIM": 128,
                "GDC": False,
                "L2_PREFETCH": False,
                "SPLIT_K": 1,
                "PERSISTENT": False,
                "TWO_STEP": False,
                "EARLY_EPILOGUE": False,
                "X_AHEAD": False,
                "LATE_TRIGGER": False,
            }
            name = (
                f"quant_matmul.fused_gemv[{format}xbf16,norm={norm_in},gated={gated},"
                f"add={add_norm},rope={rope}]"
            )
            specs.append(AotSpec(name, fused_gemv_kernel, signature, constexprs))
    return specs
