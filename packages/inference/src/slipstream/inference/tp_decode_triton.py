"""The Triton kernel of :mod:`slipstream.inference.tp_decode` (imported on first use)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _peer_values(
    mine, region, kk, k_ok, e, err_ptr, PACKED: tl.constexpr, WAIT: tl.constexpr, SPIN
):
    """fp32 values of one peer's pushed row at columns ``kk`` (its ``region`` of this rank's
    receive buffer ``mine``); ``WAIT``: poll until every slot carries call ``e`` first."""
    if PACKED:
        src = mine + region + kk // 2
    else:
        src = mine + region + kk
    v = tl.load(src, mask=k_ok, other=0, volatile=True)
    if WAIT:
        done = tl.min(((~k_ok) | ((v >> 32).to(tl.int32) == e)).to(tl.int32), axis=0)
        spins = 0
        while (done == 0) & (spins < SPIN):
            v = tl.load(src, mask=k_ok, other=0, volatile=True)
            done = tl.min(((~k_ok) | ((v >> 32).to(tl.int32) == e)).to(tl.int32), axis=0)
            spins += 1
        tl.store(err_ptr, 1, mask=done == 0)
    w = v.to(tl.int32)
    if PACKED:  # two bf16 per word: the low half is the even column
        return tl.where((kk % 2) == 0, w << 16, w & -65536).to(tl.float32, bitcast=True)
    return w.to(tl.float32, bitcast=True)


@triton.jit
def _total(
    x_row,
    p_row,
    mine,
    pull_base,
    region_words,
    row_words,
    row,
    kk,
    k_ok,
    e,
    err_ptr,
    PULL: tl.constexpr,
    PACKED: tl.constexpr,
    WAIT: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    SPIN,
):
    """``x + partial`` at columns ``kk`` in fp32 (the caller rounds it); ``PULL``: the
    partial is every rank's, summed in fp32 in rank order (this rank's from ``p_row``, the
    peers' from the receive buffer), as ``allreduce_norm.reference`` adds them."""
    t = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
    if PULL:
        acc = tl.zeros_like(t)
        for p in tl.static_range(WORLD):
            if p == RANK:
                acc += tl.load(p_row + kk, mask=k_ok, other=0.0).to(tl.float32)
            else:
                region = pull_base + p * region_words + row * row_words
                acc += _peer_values(mine, region, kk, k_ok, e, err_ptr, PACKED, WAIT, SPIN)
        return acc + t
    r = tl.load(p_row + kk, mask=k_ok, other=0.0).to(tl.float32)
    return t + r


@triton.jit
def tp_gemv_kernel(
    x_ptr,  # the input rows (NORM: the residual stream; GATED: [gate, up]; PLAIN: the input)
    p_ptr,  # NORM: this rank's partial rows to add (PULL: plus the peers' pushed ones)
    nw_ptr,  # NORM: the RMSNorm weight
    total_ptr,  # NORM: out, x + the summed partials (program 0 writes it)
    w_ptr,
    b_ptr,
    y_ptr,  # out: the projection (PUSH: this rank's partial, also pushed to every peer)
    recv_ptrs,  # int64 (WORLD,): every rank's receive buffer (int64 slots)
    step_ptr,  # int32 (1,): the decode step's number, the same on every rank
    err_ptr,  # int32 (1,): set when a wait for a peer's words gave up
    N,
    K,
    x_stride,
    y_stride,
    eps,
    pull_base,  # slot offset of the pulled site's regions (one per sender) in a receive buffer
    push_base,  # slot offset of the pushed site's regions
    region_words,  # slots per (site, sender) region
    PROLOGUE: tl.constexpr,  # 0 plain, 1 add + RMSNorm (norm_gemv), 2 SiLU * up (gated_gemv)
    HAS_NORM_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PULL: tl.constexpr,
    PUSH: tl.constexpr,
    PACKED: tl.constexpr,  # bf16 words of two columns (else fp32, one column a word)
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    SPIN: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next weight tile before each step's math (one block each)
    ROW: tl.constexpr,  # > 0 (== K): the normed row is kept in registers (a norm prologue)
):
    """The decode GEMV of ``slipstream.kernels`` (whole rows per program, a grid over the
    output blocks) with the tensor-parallel sum folded in: ``PUSH`` stores each output word,
    beside the step's number, into every peer's receive buffer as it is computed; ``PULL`` (a
    norm prologue) waits for the peers' words of that site and adds them to this rank's partial
    and the residual before the RMSNorm. See the note in :mod:`slipstream.inference.tp_decode`.
    ``PREFETCH`` (a grid of one program per block only): the first weight tile is requested
    before the prologue, so that its latency hides behind the wait for the peers' words.
    ``ROW`` (``K``, a power-of-two multiple of ``BLOCK_K``): the prologue reads the whole row
    once and keeps it normalised in registers, ``(ROW // BLOCK_K, BLOCK_K)``; each K step picks
    its slice from there instead of reading the row (and the peers' words) again.
    """
    pid_n = tl.program_id(0)
    programs = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * x_stride
    p_row = p_ptr + row * K
    e = tl.load(step_ptr)
    mine = tl.load(recv_ptrs + RANK).to(tl.pointer_type(tl.int64))
    row_words = K // 2 if PACKED else K  # the pulled row's words
    dtype = y_ptr.dtype.element_ty
    rstd = 0.0
    if PREFETCH:  # this program's one block: its first tile, before the prologue's wait
        first = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_next = tl.load(
            w_ptr + first[:, None].to(tl.int64) * K + k[None, :],
            mask=(first < N)[:, None] & (k < K)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
    if PROLOGUE == 1 and ROW > 0:
        store_end = tl.where(pid_n == 0, K, 0)  # only program 0 writes the residual sum
        kr = tl.arange(0, ROW)
        t = _total(
            x_row, p_row, mine, pull_base, region_words, row_words, row, kr, kr < K, e,
            err_ptr, PULL, PACKED, True, RANK, WORLD, SPIN,
        ).to(dtype)  # fmt: skip
        tl.store(total_ptr + row * K + kr, t, mask=kr < store_end)
        t = t.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(t * t, axis=0) / K + eps)
        normed = t * rstd
        if HAS_NORM_WEIGHT:
            normed = normed * tl.load(nw_ptr + kr).to(tl.float32)
        normed = normed.to(dtype).to(tl.float32)
        row_tiles = tl.reshape(normed, (ROW // BLOCK_K, BLOCK_K))
        tile_index = tl.arange(0, ROW // BLOCK_K)
    elif PROLOGUE == 1:
        store_end = tl.where(pid_n == 0, K, 0)  # only program 0 writes the residual sum
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            k_ok = kk < K
            t = _total(
                x_row, p_row, mine, pull_base, region_words, row_words, row, kk, k_ok, e,
                err_ptr, PULL, PACKED, True, RANK, WORLD, SPIN,
            ).to(dtype)  # fmt: skip
            tl.store(total_ptr + row * K + kk, t, mask=kk < store_end)
            t = t.to(tl.float32)
            squares += t * t
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    for block in range(pid_n, tl.cdiv(N, BLOCK_N), programs):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        w_rows = w_ptr + cols[:, None].to(tl.int64) * K
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            k_ok = kk < K
            if PREFETCH:
                w = w_next
                ahead = kk + BLOCK_K
                w_next = tl.load(
                    w_rows + ahead[None, :],
                    mask=col_ok[:, None] & (ahead < K)[None, :],
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
            elif PROLOGUE == 1 and ROW > 0:
                pick = (tile_index == k0 // BLOCK_K)[:, None]
                h = tl.sum(tl.where(pick, row_tiles, 0.0), axis=0)
            elif PROLOGUE == 1:
                # The peers' words were all seen in the first pass: no waiting here (they
                # stay until this kernel has ended, see the note).
                t = _total(
                    x_row, p_row, mine, pull_base, region_words, row_words, row, kk, k_ok, e,
                    err_ptr, PULL, PACKED, False, RANK, WORLD, SPIN,
                ).to(dtype)  # fmt: skip
                h = t.to(tl.float32) * rstd
                if HAS_NORM_WEIGHT:
                    h = h * tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
                h = h.to(dtype).to(tl.float32)
            else:
                h = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * h[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = y.to(dtype)
        tl.store(y_ptr + row * y_stride + cols, y, mask=col_ok)
        if PUSH:
            flag = e.to(tl.int64) << 32
            if PACKED:
                bits = y.to(tl.int16, bitcast=True).to(tl.int32) & 65535
                lo, hi = tl.split(tl.reshape(bits, (BLOCK_N // 2, 2)))
                word = lo | (hi << 16)
                index = block * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                index_ok = index < N // 2
                out_words = N // 2
            else:
                word = y.to(tl.int32, bitcast=True)
                index = cols
                index_ok = col_ok
                out_words = N
            packed = flag | word.to(tl.uint32).to(tl.int64)
            for p in tl.static_range(WORLD):
                if p != RANK:
                    dst = tl.load(recv_ptrs + p).to(tl.pointer_type(tl.int64))
                    region = push_base + RANK * region_words + row * out_words
                    tl.store(dst + region + index, packed, mask=index_ok)
