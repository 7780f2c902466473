"""Triton RMSNorm over the last dimension: fused forward and backward (CUDA and ROCm)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import AotSpec, as_rows, block_for, check_kernel_device

# Rows whose weight-gradient contributions one program sums before writing a partial row.
DW_ROWS_PER_PROGRAM = 64


@triton.jit
def rms_norm_forward_kernel(
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
    """One program per row: ``y = x * rsqrt(mean(x^2) + eps) * w``; saves ``rstd`` for backward."""
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
    """One program per row: ``dx = rstd * g - x * rstd^3 * mean(g * x)`` with ``g = dy * w``."""
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
    """Grid (column blocks, row chunks): ``partial[chunk, cols] = sum_rows dy * x * rstd`` in fp32."""
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


def _weight_grad(
    dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    n_rows, n_cols = x.shape
    block = block_for(n_cols, cap=256)
    chunks = max(1, triton.cdiv(n_rows, DW_ROWS_PER_PROGRAM))
    # Partial sums per row chunk (chunks x cols, fp32) instead of atomics: deterministic.
    partial = torch.empty(chunks, n_cols, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_cols, block), chunks)
    rms_norm_backward_weight_kernel[grid](
        dy, x, rstd, partial, x.stride(0), n_rows, n_cols, ROWS=DW_ROWS_PER_PROGRAM, BLOCK=block
    )
    return partial.sum(0).to(weight.dtype)


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
        if n_rows and n_cols:
            rms_norm_forward_kernel[(n_rows,)](
                rows,
                weight if weight is not None else rows,
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
        # The kernels address dy and x with one row stride, so make dy's layout match x's.
        dy = grad_out.reshape(n_rows, n_cols).contiguous()
        if rows.stride(0) != n_cols:
            rows = rows.contiguous()
        dx = torch.empty_like(dy)
        if n_rows and n_cols:
            rms_norm_backward_input_kernel[(n_rows,)](
                dy,
                rows,
                weight if weight is not None else rows,
                rstd,
                dx,
                n_cols,
                n_cols,
                HAS_WEIGHT=weight is not None,
                BLOCK=block_for(n_cols),
            )
        dw = None
        if weight is not None and ctx.needs_input_grad[1]:
            dw = _weight_grad(dy, rows, rstd, weight)
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
        specs.append(
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
                    "n_cols": "i32",
                    "eps": "fp32",
                    "HAS_WEIGHT": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"HAS_WEIGHT": True, "BLOCK": 1024},
            )
        )
        specs.append(
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
                {"HAS_WEIGHT": True, "BLOCK": 1024},
            )
        )
        specs.append(
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
            )
        )
    return specs
