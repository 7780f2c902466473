"""The Triton kernel of :mod:`slipstream.inference.allreduce_norm` (imported on first use)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_flag(flag_ptr, err_ptr, SPIN: tl.constexpr):
    """Spin until ``*flag_ptr`` is 1, then reset it to 0 (acquire, system scope)."""
    old = tl.atomic_cas(flag_ptr, 1, 0, sem="acquire", scope="sys")
    spins = 0
    while (old != 1) & (spins < SPIN):
        old = tl.atomic_cas(flag_ptr, 1, 0, sem="acquire", scope="sys")
        spins += 1
    tl.store(err_ptr, 1, mask=old != 1)


@triton.jit
def reduce_add_rms_norm_kernel(
    local_ptr,  # this rank's partial rows (rows, n_cols)
    residual_ptr,  # (NORM)
    weight_ptr,
    total_ptr,  # out (NORM): the new residual
    out_ptr,  # out: its RMSNorm (NORM), else the sum
    buffer_ptrs,  # int64 (world,): every rank's symmetric buffer
    pad_ptrs,  # int64 (world,): every rank's signal pad
    err_ptr,  # int32 (1,): set when a wait gave up
    rows,
    n_cols,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    NORM: tl.constexpr,  # False: the sum only (into out), no residual
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
    SPIN: tl.constexpr,
):
    b = tl.program_id(0)
    nb = tl.num_programs(0)
    dtype = local_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    keep = cols < n_cols
    my_pad = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32))
    # The buffers are 16-byte aligned and rows hold a multiple of 8 elements (the caller checks):
    # the hints let the copies and the peer loads use 16-byte accesses.
    my_buffer = tl.multiple_of(tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype)), 16)
    # (1) the peers are done reading this rank's buffer (from the previous call)
    for p in tl.static_range(WORLD):
        if p != RANK:
            wait_flag(my_pad + (b * 2 + 1) * WORLD + p, err_ptr, SPIN)
    # (2) this rank's rows into its buffer
    for row in range(b, rows, nb):
        offsets = row * n_cols + cols  # < the buffer size: int32 is enough
        x = tl.load(local_ptr + offsets, mask=keep, other=0.0)
        tl.store(my_buffer + offsets, x, mask=keep)
    tl.debug_barrier()  # every thread's stores precede the release below
    # (3) tell every peer this rank's rows are there
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer_pad = tl.load(pad_ptrs + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_pad + (b * 2 + 0) * WORLD + RANK, 1, sem="release", scope="sys")
    # (4) wait for every peer's rows
    for p in tl.static_range(WORLD):
        if p != RANK:
            wait_flag(my_pad + (b * 2 + 0) * WORLD + p, err_ptr, SPIN)
    tl.debug_barrier()  # the acquire above precedes every thread's loads below
    # (5) sum in rank order (the same bits on every rank); add and normalize (NORM)
    for row in range(b, rows, nb):
        offsets = row * n_cols + cols  # < the buffer size: int32 is enough
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                part = tl.load(local_ptr + offsets, mask=keep, other=0.0)
            else:
                peer = tl.multiple_of(tl.load(buffer_ptrs + p).to(tl.pointer_type(dtype)), 16)
                # .cv: read the peer's memory again, never a cached line of an earlier call
                part = tl.load(peer + offsets, mask=keep, other=0.0, cache_modifier=".cv")
            acc += part.to(tl.float32)
        if NORM:
            r = tl.load(residual_ptr + offsets, mask=keep, other=0.0).to(tl.float32)
            total = (acc + r).to(dtype)
            tl.store(total_ptr + offsets, total, mask=keep)
            t = total.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(t * t, axis=0) / n_cols + eps)
            y = t * rstd
            if HAS_WEIGHT:
                y = y * tl.load(weight_ptr + cols, mask=keep, other=0.0).to(tl.float32)
            tl.store(out_ptr + offsets, y.to(dtype), mask=keep)
        else:
            tl.store(out_ptr + offsets, acc.to(dtype), mask=keep)
    tl.debug_barrier()  # every thread's peer loads are done before the peers may overwrite
    # (6) tell every peer its buffer may be written again
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer_pad = tl.load(pad_ptrs + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_pad + (b * 2 + 1) * WORLD + RANK, 1, sem="release", scope="sys")
