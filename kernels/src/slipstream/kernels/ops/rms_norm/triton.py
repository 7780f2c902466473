"""Triton RMSNorm over the last dimension: fused forward and backward (CUDA and ROCm).

Design (the same for ``layer_norm``, which imports this module's launch helpers):

* Rows of up to :data:`MAX_FUSED_COLS` elements are held whole in registers, so the forward
  reads ``x`` once and writes ``y`` once. Narrow rows are packed several to a program (a
  ``(ROWS, BLOCK)`` tile of about :data:`TILE_ELEMENTS` elements) so tiny rows do not each pay
  for a program.
* The backward is one persistent kernel: a grid of a few programs per SM, each looping over its
  row tiles; it reads ``dy`` and ``x`` once, writes ``dx``, and accumulates the weight gradient
  in fp32 registers, writing one partial row per program. ``partial.sum(0)`` finishes it, so the
  result is deterministic (no atomics) and ``dy``/``x`` are never read a second time.
* Wider rows fall back to looped kernels that stream each row in ``BLOCK``-wide pieces (two
  passes over the row) with a separate weight-gradient kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import (
    AotSpec,
    as_rows,
    block_for,
    check_kernel_device,
    next_power_of_2,
)

# Widest row held whole in registers; wider rows take the looped kernels. 16384 fp32 values over
# 16 warps are 32 registers per thread per live row-sized tensor: the backward's dy, x and fp32
# gradient accumulators still fit (on an H100 at 4096 x 16384 bf16 the fused backward took
# 0.22 ms for rms_norm and 0.28 ms for layer_norm, against 0.14 ms to move its bytes).
MAX_FUSED_COLS = 16384
# Elements one program's tile aims for when several narrow rows share a program.
TILE_ELEMENTS = 2048
# Persistent backward: programs per SM. On an H100, 2 to 8 were within 5% of each other for 4096
# columns; 1 was 30% slower (too few loads in flight), and 4 was best for narrow rows.
PROGRAMS_PER_SM = 4
# Programs of the persistent backward where no GPU is present (Triton's CPU interpreter).
FALLBACK_PROGRAMS = 4
# Rows whose weight-gradient contributions one program sums in the wide-row fallback.
DW_ROWS_PER_PROGRAM = 64


def row_tile(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """``(ROWS, BLOCK, num_warps)`` for the fused kernels: a ``(ROWS, BLOCK)`` tile per step.

    ``BLOCK`` covers the row (a power of two >= ``n_cols``); ``ROWS`` packs narrow rows up to
    about :data:`TILE_ELEMENTS` elements; the warps grow with the tile so each thread keeps
    4 to 32 elements per row-sized tensor (16-byte vector accesses, no register spills).
    """
    block = max(16, next_power_of_2(n_cols))
    rows = max(1, min(TILE_ELEMENTS // block, next_power_of_2(n_rows)))
    elements = rows * block
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
    return rows, block, num_warps


@functools.cache
def _sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def persistent_programs(device: torch.device, row_tiles: int) -> int:
    """Grid size of a persistent backward: a few programs per SM, at most one per row tile."""
    if device.type == "cuda":
        programs = PROGRAMS_PER_SM * _sm_count(device)
    else:
        programs = FALLBACK_PROGRAMS
    return max(1, min(programs, row_tiles))


@triton.jit
def rms_norm_forward_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``ROWS`` whole rows per program (``BLOCK >= n_cols``), each read once into registers.

    ``y = x * rstd * w`` with ``rstd = rsqrt(mean(x^2) + eps)`` in fp32, rounded once to ``y``'s
    dtype; ``rstd`` (fp32, one per row) is saved for the backward.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = y * w[None, :]
    y_ptrs = y_ptr + rows[:, None] * y_row_stride + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    row_stride,
    n_rows,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    WANT_DW: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Persistent: program ``p`` of ``G`` takes row tiles ``p, p + G, ...`` (whole rows each).

    Per row, with ``g = dy * w``: ``dx = rstd * g - x * rstd^3 * mean(g * x)``, from one read of
    ``dy`` and ``x``. With ``WANT_DW`` it also sums ``dy * x * rstd`` over its rows in fp32 and
    writes that sum to row ``p`` of ``dw_partial`` (``G x n_cols``).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for first in range(pid * ROWS, n_rows, programs * ROWS):
        rows = first + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * w[None, :]
        correction = tl.sum(g * x, axis=1) / n_cols * rstd * rstd * rstd
        dx = g * rstd[:, None] - x * correction[:, None]
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WANT_DW:
            dw += dy * x * rstd[:, None]
    if WANT_DW:
        tl.store(dw_partial_ptr + pid.to(tl.int64) * n_cols + cols, tl.sum(dw, axis=0), col_mask)


@triton.jit
def rms_norm_forward_looped_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Wide rows, one program per row, two passes of ``BLOCK``: the sum of squares, then ``y``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_input_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    row_stride,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Wide rows, one program per row: ``dx`` as in the fused kernel, in two passes of ``BLOCK``."""
    row = tl.program_id(0).to(tl.int64)
    rstd = tl.load(rstd_ptr + row)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(dy_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = g * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dot += g * x
    correction = tl.sum(dot, axis=0) / n_cols * rstd * rstd * rstd
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(dy_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = g * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dx = g * rstd - x * correction
        tl.store(dx_ptr + row * row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_backward_weight_kernel(
    dy_ptr,
    x_ptr,
    rstd_ptr,
    partial_ptr,
    row_stride,
    n_rows,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Wide rows, grid (column blocks, row chunks): ``partial[chunk] = sum_rows dy * x * rstd``."""
    col_block = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    first = chunk.to(tl.int64) * ROWS
    last = tl.minimum(first + ROWS, n_rows)
    for row64 in range(first, last):
        dy = tl.load(dy_ptr + row64 * row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row64 * row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc += dy * x * tl.load(rstd_ptr + row64)
    tl.store(partial_ptr + chunk.to(tl.int64) * n_cols + cols, acc, mask=col_mask)


def _backward_fused(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dx: torch.Tensor,
    want_dw: bool,
) -> torch.Tensor | None:
    n_rows, n_cols = x.shape
    rows, block, num_warps = row_tile(n_rows, n_cols)
    programs = persistent_programs(x.device, triton.cdiv(n_rows, rows))
    # One fp32 partial row per program instead of atomics: deterministic.
    partial = (
        torch.empty(programs, n_cols, dtype=torch.float32, device=x.device) if want_dw else None
    )
    rms_norm_backward_kernel[(programs,)](
        dy,
        x,
        weight if weight is not None else x,
        rstd,
        dx,
        partial if partial is not None else rstd,
        n_cols,
        n_rows,
        n_cols,
        HAS_WEIGHT=weight is not None,
        WANT_DW=want_dw,
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps,
    )
    return partial.sum(0) if partial is not None else None


def _backward_looped(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    dx: torch.Tensor,
    want_dw: bool,
) -> torch.Tensor | None:
    n_rows, n_cols = x.shape
    rms_norm_backward_input_kernel[(n_rows,)](
        dy,
        x,
        weight if weight is not None else x,
        rstd,
        dx,
        n_cols,
        n_cols,
        HAS_WEIGHT=weight is not None,
        BLOCK=block_for(n_cols),
    )
    if not want_dw:
        return None
    block = block_for(n_cols, cap=256)
    chunks = triton.cdiv(n_rows, DW_ROWS_PER_PROGRAM)
    # Partial sums per row chunk (chunks x cols, fp32) instead of atomics: deterministic.
    partial = torch.empty(chunks, n_cols, dtype=torch.float32, device=x.device)
    rms_norm_backward_weight_kernel[(triton.cdiv(n_cols, block), chunks)](
        dy, x, rstd, partial, n_cols, n_rows, n_cols, ROWS=DW_ROWS_PER_PROGRAM, BLOCK=block
    )
    return partial.sum(0)


class TritonRMSNorm(torch.autograd.Function):
    """Autograd wrapper: forward saves ``x`` and one fp32 ``rstd`` per row; backward is fused."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        shape = x.shape
        rows = as_rows(x)
        n_rows, n_cols = rows.shape
        out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        w = weight if weight is not None else rows
        if n_rows and n_cols and n_cols <= MAX_FUSED_COLS:
            tile_rows, block, num_warps = row_tile(n_rows, n_cols)
            rms_norm_forward_kernel[(triton.cdiv(n_rows, tile_rows),)](
                rows,
                w,
                out,
                rstd,
                rows.stride(0),
                out.stride(0),
                n_rows,
                n_cols,
                eps,
                HAS_WEIGHT=weight is not None,
                ROWS=tile_rows,
                BLOCK=block,
                num_warps=num_warps,
            )
        elif n_rows and n_cols:
            rms_norm_forward_looped_kernel[(n_rows,)](
                rows,
                w,
                out,
                rstd,
                rows.stride(0),
                out.stride(0),
                n_cols,
                eps,
                HAS_WEIGHT=weight is not None,
                BLOCK=block_for(n_cols),
            )
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = shape
        return out.reshape(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rows, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = rows.shape
        # The kernels address dy, x and dx with one row stride, so make dy's layout match x's.
        dy = grad_out.reshape(n_rows, n_cols).contiguous()
        if rows.stride(0) != n_cols:
            rows = rows.contiguous()
        dx = torch.empty_like(dy)
        want_dw = weight is not None and ctx.needs_input_grad[1]
        dw_sum = None
        if n_rows and n_cols:
            backward = _backward_fused if n_cols <= MAX_FUSED_COLS else _backward_looped
            dw_sum = backward(dy, rows, weight, rstd, dx, want_dw)
        dw = None
        if want_dw:
            dw = (dw_sum if dw_sum is not None else torch.zeros_like(weight)).to(weight.dtype)
        return dx.reshape(ctx.shape), dw, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Triton RMSNorm with the semantics of :func:`..reference.rms_norm` (fp32 math, one rounding).

    Differentiable in ``x`` and ``weight`` through a fused backward.
    """
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight shape {tuple(weight.shape)} must equal the last dimension of x "
            f"{tuple(x.shape[-1:])}"
        )
    check_kernel_device("rms_norm", x, weight)
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    return TritonRMSNorm.apply(x, weight, float(eps))  # type: ignore[no-any-return]


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("fp32", "bf16", "fp16"):
        specs += [
            AotSpec(
                f"rms_norm.forward[{dtype}]",
                rms_norm_forward_kernel,
                {
                    "x_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}",
                    "y_ptr": f"*{dtype}",
                    "rstd_ptr": "*fp32",
                    "x_row_stride": "i64",
                    "y_row_stride": "i64",
                    "n_rows": "i32",
                    "n_cols": "i32",
                    "eps": "fp32",
                    "HAS_WEIGHT": "constexpr",
                    "ROWS": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"HAS_WEIGHT": True, "ROWS": 1, "BLOCK": 4096},
            ),
            AotSpec(
                f"rms_norm.backward[{dtype}]",
                rms_norm_backward_kernel,
                {
                    "dy_ptr": f"*{dtype}",
                    "x_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}",
                    "rstd_ptr": "*fp32",
                    "dx_ptr": f"*{dtype}",
                    "dw_partial_ptr": "*fp32",
                    "row_stride": "i64",
                    "n_rows": "i32",
                    "n_cols": "i32",
                    "HAS_WEIGHT": "constexpr",
                    "WANT_DW": "constexpr",
                    "ROWS": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"HAS_WEIGHT": True, "WANT_DW": True, "ROWS": 1, "BLOCK": 4096},
            ),
            AotSpec(
                f"rms_norm.forward_looped[{dtype}]",
                rms_norm_forward_looped_kernel,
                {
                    "x_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}",
                    "y_ptr": f"*{dtype}",
                    "rstd_ptr": "*fp32",
                    "x_row_stride": "i64",
                    "y_row_stride": "i64",
                    "n_cols": "i32",
                    "eps": "fp32",
                    "HAS_WEIGHT": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"HAS_WEIGHT": True, "BLOCK": 4096},
            ),
            AotSpec(
                f"rms_norm.backward_input[{dtype}]",
                rms_norm_backward_input_kernel,
                {
                    "dy_ptr": f"*{dtype}",
                    "x_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}",
                    "rstd_ptr": "*fp32",
                    "dx_ptr": f"*{dtype}",
                    "row_stride": "i64",
                    "n_cols": "i32",
                    "HAS_WEIGHT": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"HAS_WEIGHT": True, "BLOCK": 4096},
            ),
            AotSpec(
                f"rms_norm.backward_weight[{dtype}]",
                rms_norm_backward_weight_kernel,
                {
                    "dy_ptr": f"*{dtype}",
                    "x_ptr": f"*{dtype}",
                    "rstd_ptr": "*fp32",
                    "partial_ptr": "*fp32",
                    "row_stride": "i64",
                    "n_rows": "i32",
                    "n_cols": "i32",
                    "ROWS": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"ROWS": DW_ROWS_PER_PROGRAM, "BLOCK": 256},
            ),
        ]
    return specs
