"""Triton argmax over the last dimension in one launch.

A decode step's greedy choice reads one row of logits (128K of them for Llama 3). One program
per ``BLOCK`` columns of a row writes its chunk's maximum and the first index of it (or of the
chunk's first NaN) to a workspace; the last program of the row to arrive (an arrival counter,
reset by that program, so a CUDA graph replays the launch as captured) reduces the chunks in
column order and stores the row's index. Ties resolve to the lowest index and a NaN wins over
every number, as ``torch.argmax`` does: the result equals it exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.argmax.reference import check_shapes
from slipstream.kernels.triton_support import (
    AotSpec,
    arrival_counters,
    check_kernel_device,
    next_power_of_2,
)

__all__ = ["BLOCK", "argmax"]

BLOCK = 1024  # columns per program (a 128256-wide row: 126 programs)
_BEYOND: tl.constexpr = tl.constexpr(2**31 - 1)  # an index past every column


@triton.jit
def _first_of_max(values, index, ok):
    """The maximum of ``values`` where ``ok`` (NaN if one is NaN) and the lowest ``index``
    holding it (the lowest NaN's, if any)."""
    nan = (values != values) & ok
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(ok & ~nan, values, float("-inf")), axis=0)
    hit = tl.where(any_nan, nan, ok & (values == best))
    first = tl.min(tl.where(hit, index, _BEYOND), axis=0)
    best = tl.where(any_nan, float("nan"), best)
    return best, first


@triton.jit
def argmax_kernel(
    x_ptr,
    out_ptr,
    val_ptr,
    idx_ptr,
    counter_ptr,
    N,
    stride_row,
    CHUNKS,
    BLOCK: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
):
    """Chunk ``program_id(0)`` of row ``program_id(1)``; the row's last arrival reduces."""
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + cols, mask=ok, other=float("-inf"))
    best, first = _first_of_max(x.to(tl.float32), cols, ok)
    slot = row * CHUNKS + chunk
    tl.store(val_ptr + slot, best)
    tl.store(idx_ptr + slot, first)
    tl.debug_barrier()  # every thread's stores precede the arrival (release)
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel")
    if arrived == CHUNKS - 1:
        c = tl.arange(0, CHUNKS_POW2)
        c_ok = c < CHUNKS
        vals = tl.load(
            val_ptr + row * CHUNKS + c, mask=c_ok, other=float("-inf"), cache_modifier=".cg"
        )
        idx = tl.load(idx_ptr + row * CHUNKS + c, mask=c_ok, other=_BEYOND, cache_modifier=".cg")
        _best, winner = _first_of_max(vals, idx, c_ok)
        tl.store(out_ptr + row, winner.to(tl.int64))
        tl.atomic_xchg(counter_ptr + row, 0)


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.argmax.reference.argmax` (one launch)."""
    check_kernel_device("argmax", scores)
    check_shapes(scores)
    rows, columns = scores.shape
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    chunks = triton.cdiv(columns, BLOCK)
    out = torch.empty(rows, device=scores.device, dtype=torch.int64)
    values = torch.empty(rows * chunks, device=scores.device, dtype=torch.float32)
    index = torch.empty(rows * chunks, device=scores.device, dtype=torch.int32)
    argmax_kernel[(chunks, rows)](
        scores,
        out,
        values,
        index,
        arrival_counters("argmax", scores.device, rows),
        columns,
        scores.stride(0),
        chunks,
        BLOCK=BLOCK,
        CHUNKS_POW2=next_power_of_2(chunks),
        num_warps=4,
    )
    return out


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    return [
        AotSpec(
            f"argmax[{dtype}]",
            argmax_kernel,
            {
                "x_ptr": f"*{dtype}",
                "out_ptr": "*i64",
                "val_ptr": "*fp32",
                "idx_ptr": "*i32",
                "counter_ptr": "*i32",
                "N": "i32",
                "stride_row": "i32",
                "CHUNKS": "i32",
                "BLOCK": "constexpr",
                "CHUNKS_POW2": "constexpr",
            },
            {"BLOCK": BLOCK, "CHUNKS_POW2": 128},
        )
        for dtype in ("bf16", "fp16", "fp32")
    ]
