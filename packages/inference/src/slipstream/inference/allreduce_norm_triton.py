"""The Triton kernel of :mod:`slipstream.inference.allreduce_norm` (imported on first use)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _halves(w):
    """fp32 values of the low and high bf16 halves of int32 words."""
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _bf16_bits(x):
    """bf16 bits (round to nearest even) of fp32 ``x`` in the low 16 bits of int32 words."""
    return x.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 65535


@triton.jit
def reduce_add_rms_norm_kernel(
    local_ptr,  # int32 words of this rank's partial rows (rows, n_words)
    residual_ptr,  # int32 words (NORM)
    weight_ptr,  # int32 words (NORM and HAS_WEIGHT)
    total_ptr,  # out, int32 words (NORM): the new residual
    out_ptr,  # out, int32 words: its RMSNorm (NORM), else the sum
    recv_ptrs,  # int64 (world,): every rank's receive buffer (int64 slots)
    epoch_ptr,  # int32 (programs,): this rank's call count per program
    err_ptr,  # int32 (1,): set when a wait gave up
    rows,
    n_words,
    slot_words,  # int64 slots per (parity, sender) region of a receive buffer
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PACKED: tl.constexpr,  # two bf16 per word (else one fp32)
    NORM: tl.constexpr,  # False: the sum only, into out
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    SPIN: tl.constexpr,
):
    b = tl.program_id(0)
    nb = tl.num_programs(0)
    e = tl.load(epoch_ptr + b) + 1  # this call's number, the same on every rank
    parity = e % 2
    flag = e.to(tl.int64) << 32
    cols = tl.arange(0, BLOCK)
    keep = cols < n_words
    # (1) Push this rank's rows to every peer: each 32-bit word beside the call's number in one
    # 8-byte store (single-copy atomic), so a peer that sees the number sees the word: no fence,
    # no flag, no round trip.
    for row in range(b, rows, nb):
        w = tl.load(local_ptr + row * n_words + cols, mask=keep, other=0)
        packed = flag | w.to(tl.uint32).to(tl.int64)
        for p in tl.static_range(WORLD):
            if p != RANK:
                dst = tl.multiple_of(tl.load(recv_ptrs + p).to(tl.pointer_type(tl.int64)), 16)
                region = (parity * WORLD + RANK) * slot_words
                tl.store(dst + region + row * n_words + cols, packed, mask=keep)
    # (2) Per row: wait until every peer's words carry this call's number (polling this rank's
    # own memory), sum in rank order in fp32 (the same bits on every rank), add, normalize.
    mine = tl.multiple_of(tl.load(recv_ptrs + RANK).to(tl.pointer_type(tl.int64)), 16)
    for row in range(b, rows, nb):
        acc_lo = tl.zeros([BLOCK], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                w = tl.load(local_ptr + row * n_words + cols, mask=keep, other=0)
            else:
                src = mine + (parity * WORLD + p) * slot_words + row * n_words + cols
                v = tl.load(src, mask=keep, other=0, volatile=True)
                done = tl.min(((~keep) | ((v >> 32).to(tl.int32) == e)).to(tl.int32), axis=0)
                spins = 0
                while (done == 0) & (spins < SPIN):
                    v = tl.load(src, mask=keep, other=0, volatile=True)
                    done = tl.min(((~keep) | ((v >> 32).to(tl.int32) == e)).to(tl.int32), axis=0)
                    spins += 1
                tl.store(err_ptr, 1, mask=done == 0)
                w = v.to(tl.int32)
            if PACKED:
                lo, hi = _halves(w)
                acc_lo += lo
                acc_hi += hi
            else:
                acc_lo += w.to(tl.float32, bitcast=True)
        offsets = row * n_words + cols
        if NORM:
            r = tl.load(residual_ptr + offsets, mask=keep, other=0)
            if PACKED:
                r_lo, r_hi = _halves(r)
                total = _bf16_bits(acc_lo + r_lo) | (_bf16_bits(acc_hi + r_hi) << 16)
                tl.store(total_ptr + offsets, total, mask=keep)
                t_lo, t_hi = _halves(total)  # the norm of the rounded residual, as add_rms_norm
                n_cols = 2 * n_words
                rstd = 1.0 / tl.sqrt(
                    (tl.sum(t_lo * t_lo, 0) + tl.sum(t_hi * t_hi, 0)) / n_cols + eps
                )
                y_lo, y_hi = t_lo * rstd, t_hi * rstd
                if HAS_WEIGHT:
                    g_lo, g_hi = _halves(tl.load(weight_ptr + cols, mask=keep, other=0))
                    y_lo, y_hi = y_lo * g_lo, y_hi * g_hi
                tl.store(out_ptr + offsets, _bf16_bits(y_lo) | (_bf16_bits(y_hi) << 16), mask=keep)
            else:
                t = acc_lo + r.to(tl.float32, bitcast=True)
                tl.store(total_ptr + offsets, t.to(tl.int32, bitcast=True), mask=keep)
                rstd = 1.0 / tl.sqrt(tl.sum(t * t, 0) / n_words + eps)
                y = t * rstd
                if HAS_WEIGHT:
                    y = y * tl.load(weight_ptr + cols, mask=keep, other=0).to(
                        tl.float32, bitcast=True
                    )
                tl.store(out_ptr + offsets, y.to(tl.int32, bitcast=True), mask=keep)
        elif PACKED:
            tl.store(out_ptr + offsets, _bf16_bits(acc_lo) | (_bf16_bits(acc_hi) << 16), mask=keep)
        else:
            tl.store(out_ptr + offsets, acc_lo.to(tl.int32, bitcast=True), mask=keep)
    tl.store(epoch_ptr + b, e)
