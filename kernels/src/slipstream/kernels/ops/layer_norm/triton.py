"""Triton LayerNorm over the last dimension: fused forward and backward (CUDA and ROCm).

The design follows ``rms_norm``'s (see that module's docstring, and its launch helpers used
here): rows of up to ``MAX_FUSED_COLS`` elements are read once into registers, a persistent
backward reads ``dy`` and ``x`` once and accumulates the weight and bias gradients in fp32 per
program, and wider rows fall back to looped kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.rms_norm.triton import (
    DW_ROWS_PER_PROGRAM,
    MAX_FUSED_COLS,
    persistent_programs,
    row_tile,
)
from slipstream.kernels.triton_support import AotSpec, as_rows, block_for, check_kernel_device


@triton.jit
def layer_norm_forward_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``ROWS`` whole rows per program (``BLOCK >= n_cols``), each read once into registers.

    ``y = (x - mean) * rstd * w + b`` in fp32, rounded once; the variance is the two-pass one
    (mean of squared deviations, no cancellation for large means), taken from registers. Saves
    ``mean`` and ``rstd`` (fp32, one per row) for the backward.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    row_mask = rows < n_rows
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = centred * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None] * y_row_stride + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    row_stride,
    n_rows,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    WANT_DW: tl.constexpr,
    WANT_DB: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Persistent: program ``p`` of ``G`` takes row tiles ``p, p + G, ...`` (whole rows each).

    Per row, with ``xhat = (x - mean) * rstd`` and ``g = dy * w``:
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, from one read of ``dy`` and ``x``.
    ``WANT_DW``/``WANT_DB`` also sum ``dy * xhat``/``dy`` over the program's rows in fp32 and
    write the sums to row ``p`` of ``dw_partial``/``db_partial`` (``G x n_cols`` each).
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for first in range(pid * ROWS, n_rows, programs * ROWS):
        rows = first + tl.arange(0, ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy
        if HAS_WEIGHT:
            g = dy * w[None, :]
        mean_g = tl.sum(g, axis=1) / n_cols
        mean_gx = tl.sum(g * xhat, axis=1) / n_cols
        dx = (g - mean_g[:, None] - xhat * mean_gx[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WANT_DW:
            dw += dy * xhat
        if WANT_DB:
            db += dy
    partial_row = pid.to(tl.int64) * n_cols + cols
    if WANT_DW:
        tl.store(dw_partial_ptr + partial_row, tl.sum(dw, axis=0), mask=col_mask)
    if WANT_DB:
        tl.store(db_partial_ptr + partial_row, tl.sum(db, axis=0), mask=col_mask)


@triton.jit
def layer_norm_forward_looped_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Wide rows, one program per row, three passes of ``BLOCK``: mean, variance, then ``y``."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    y_row = y_ptr + row * y_row_stride
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        total += tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    mean = tl.sum(total, axis=0) / n_cols
    # Two-pass variance (sum of squared deviations): no cancellation for large means.
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        centred = tl.where(mask, x - mean, 0.0)
        squares += centred * centred
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / n_cols + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_backward_input_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    row_stride,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Wide rows, one program per row: ``dx`` as in the fused kernel, in two passes of ``BLOCK``."""
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    sum_g = tl.zeros([BLOCK], dtype=tl.float32)
    sum_gx = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(dy_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = g * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        sum_g += g
        sum_gx += g * xhat
    mean_g = tl.sum(sum_g, axis=0) / n_cols
    mean_gx = tl.sum(sum_gx, axis=0) / n_cols
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(dy_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = g * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        dx = (g - mean_g - xhat * mean_gx) * rstd
        tl.store(dx_ptr + row * row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_backward_params_kernel(
    dy_ptr,
    x_ptr,
    mean_ptr,
    rstd_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    row_stride,
    n_rows,
    n_cols,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Wide rows, grid (column blocks, row chunks): fp32 partial sums of ``dy * xhat``, ``dy``."""
    col_block = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    first = chunk.to(tl.int64) * ROWS
    last = tl.minimum(first + ROWS, n_rows)
    for row in range(first, last):
        dy = tl.load(dy_ptr + row * row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * row_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
        xhat = (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row)
        dw += dy * xhat
        db += dy
    offset = chunk.to(tl.int64) * n_cols + cols
    tl.store(dw_partial_ptr + offset, dw, mask=col_mask)
    tl.store(db_partial_ptr + offset, db, mask=col_mask)


def _backward_fused(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dx: torch.Tensor,
    want_dw: bool,
    want_db: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    n_rows, n_cols = x.shape
    rows, block, num_warps = row_tile(n_rows, n_cols)
    programs = persistent_programs(x.device, triton.cdiv(n_rows, rows))
    # One fp32 partial row per program and gradient instead of atomics: deterministic. The
    # gradients share one buffer so that one allocation and one reduction serve both.
    partial = torch.empty(want_dw + want_db, programs, n_cols, dtype=torch.float32, device=x.device)
    layer_norm_backward_kernel[(programs,)](
        dy,
        x,
        weight if weight is not None else x,
        mean,
        rstd,
        dx,
        partial[0] if want_dw else rstd,
        partial[-1] if want_db else rstd,
        n_cols,
        n_rows,
        n_cols,
        HAS_WEIGHT=weight is not None,
        WANT_DW=want_dw,
        WANT_DB=want_db,
        ROWS=rows,
        BLOCK=block,
        num_warps=num_warps,
    )
    if not (want_dw or want_db):
        return None, None
    sums = partial.sum(1)
    return (sums[0] if want_dw else None), (sums[-1] if want_db else None)


def _backward_looped(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dx: torch.Tensor,
    want_dw: bool,
    want_db: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    n_rows, n_cols = x.shape
    layer_norm_backward_input_kernel[(n_rows,)](
        dy,
        x,
        weight if weight is not None else x,
        mean,
        rstd,
        dx,
        n_cols,
        n_cols,
        HAS_WEIGHT=weight is not None,
        BLOCK=block_for(n_cols),
    )
    if not (want_dw or want_db):
        return None, None
    block = block_for(n_cols, cap=256)
    chunks = triton.cdiv(n_rows, DW_ROWS_PER_PROGRAM)
    # Partial sums per row chunk (chunks x cols, fp32) instead of atomics: deterministic.
    dw_partial = torch.empty(chunks, n_cols, dtype=torch.float32, device=x.device)
    db_partial = torch.empty(chunks, n_cols, dtype=torch.float32, device=x.device)
    layer_norm_backward_params_kernel[(triton.cdiv(n_cols, block), chunks)](
        dy,
        x,
        mean,
        rstd,
        dw_partial,
        db_partial,
        n_cols,
        n_rows,
        n_cols,
        ROWS=DW_ROWS_PER_PROGRAM,
        BLOCK=block,
    )
    return dw_partial.sum(0), db_partial.sum(0)


class TritonLayerNorm(torch.autograd.Function):
    """Autograd wrapper: forward saves ``x`` plus fp32 mean and rstd per row; fused backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        shape = x.shape
        rows = as_rows(x)
        n_rows, n_cols = rows.shape
        out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
        mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        pointers = (
            rows,
            weight if weight is not None else rows,
            bias if bias is not None else rows,
            out,
            mean,
            rstd,
            rows.stride(0),
            out.stride(0),
        )
        flags = {"HAS_WEIGHT": weight is not None, "HAS_BIAS": bias is not None}
        if n_rows and n_cols and n_cols <= MAX_FUSED_COLS:
            tile_rows, block, num_warps = row_tile(n_rows, n_cols)
            layer_norm_forward_kernel[(triton.cdiv(n_rows, tile_rows),)](
                *pointers,
                n_rows,
                n_cols,
                eps,
                **flags,
                ROWS=tile_rows,
                BLOCK=block,
                num_warps=num_warps,
            )
        elif n_rows and n_cols:
            layer_norm_forward_looped_kernel[(n_rows,)](
                *pointers, n_cols, eps, **flags, BLOCK=block_for(n_cols)
            )
        ctx.save_for_backward(rows, weight, bias, mean, rstd)
        ctx.shape = shape
        return out.reshape(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rows, weight, bias, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = rows.shape
        dy = grad_out.reshape(n_rows, n_cols).contiguous()
        if rows.stride(0) != n_cols:
            rows = rows.contiguous()  # the kernels address dy, x and dx with one row stride
        dx = torch.empty_like(dy)
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = bias is not None and ctx.needs_input_grad[2]
        dw_sum = db_sum = None
        if n_rows and n_cols:
            backward = _backward_fused if n_cols <= MAX_FUSED_COLS else _backward_looped
            dw_sum, db_sum = backward(dy, rows, weight, mean, rstd, dx, want_dw, want_db)
        dw = db = None
        if want_dw:
            dw = (dw_sum if dw_sum is not None else torch.zeros_like(weight)).to(weight.dtype)
        if want_db:
            db = (db_sum if db_sum is not None else torch.zeros_like(bias)).to(bias.dtype)
        return dx.reshape(ctx.shape), dw, db, None


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Triton LayerNorm with the semantics of :func:`..reference.layer_norm` (biased variance).

    Differentiable in ``x``, ``weight`` and ``bias`` through a fused backward.
    """
    hidden_size = x.shape[-1]
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.shape != (hidden_size,):
            raise ValueError(
                f"layer_norm: {name} shape {tuple(tensor.shape)} must be ({hidden_size},), the "
                "last dimension of x"
            )
    check_kernel_device("layer_norm", x, weight, bias)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    return TritonLayerNorm.apply(x, weight, bias, float(eps))  # type: ignore[no-any-return]


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("fp32", "bf16", "fp16"):
        forward_signature = {
            "x_ptr": f"*{dtype}",
            "w_ptr": f"*{dtype}",
            "b_ptr": f"*{dtype}",
            "y_ptr": f"*{dtype}",
            "mean_ptr": "*fp32",
            "rstd_ptr": "*fp32",
            "x_row_stride": "i64",
            "y_row_stride": "i64",
            "n_rows": "i32",
            "n_cols": "i32",
            "eps": "fp32",
            "HAS_WEIGHT": "constexpr",
            "HAS_BIAS": "constexpr",
            "ROWS": "constexpr",
            "BLOCK": "constexpr",
        }
        looped_signature = {
            k: v for k, v in forward_signature.items() if k not in ("n_rows", "ROWS")
        }
        specs += [
            AotSpec(
                f"layer_norm.forward[{dtype}]",
                layer_norm_forward_kernel,
                forward_signature,
                {"HAS_WEIGHT": True, "HAS_BIAS": True, "ROWS": 1, "BLOCK": 4096},
            ),
            AotSpec(
                f"layer_norm.backward[{dtype}]",
                layer_norm_backward_kernel,
                {
                    "dy_ptr": f"*{dtype}",
                    "x_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}",
                    "mean_ptr": "*fp32",
                    "rstd_ptr": "*fp32",
                    "dx_ptr": f"*{dtype}",
                    "dw_partial_ptr": "*fp32",
                    "db_partial_ptr": "*fp32",
                    "row_stride": "i64",
                    "n_rows": "i32",
                    "n_cols": "i32",
                    "HAS_WEIGHT": "constexpr",
                    "WANT_DW": "constexpr",
                    "WANT_DB": "constexpr",
                    "ROWS": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"HAS_WEIGHT": True, "WANT_DW": True, "WANT_DB": True, "ROWS": 1, "BLOCK": 4096},
            ),
            AotSpec(
                f"layer_norm.forward_looped[{dtype}]",
                layer_norm_forward_looped_kernel,
                looped_signature,
                {"HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK": 4096},
            ),
            AotSpec(
                f"layer_norm.backward_input[{dtype}]",
                layer_norm_backward_input_kernel,
                {
                    "dy_ptr": f"*{dtype}",
                    "x_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}",
                    "mean_ptr": "*fp32",
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
                f"layer_norm.backward_params[{dtype}]",
                layer_norm_backward_params_kernel,
                {
                    "dy_ptr": f"*{dtype}",
                    "x_ptr": f"*{dtype}",
                    "mean_ptr": "*fp32",
                    "rstd_ptr": "*fp32",
                    "dw_partial_ptr": "*fp32",
                    "db_partial_ptr": "*fp32",
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
