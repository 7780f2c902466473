"""Triton LayerNorm over the last dimension: fused forward and backward (CUDA and ROCm)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import AotSpec, as_rows, block_for, check_kernel_device

DW_ROWS_PER_PROGRAM = 64


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
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: ``y = (x - mean) * rstd * w + b``; saves mean and rstd (fp32)."""
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
    """One program per row: ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, ``g = dy * w``."""
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
    """Grid (column blocks, row chunks): fp32 partial sums of ``dy * xhat`` and of ``dy``."""
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
        if n_rows and n_cols:
            layer_norm_forward_kernel[(n_rows,)](
                rows,
                weight if weight is not None else rows,
                bias if bias is not None else rows,
                out,
                mean,
                rstd,
                rows.stride(0),
                out.stride(0),
                n_cols,
                eps,
                HAS_WEIGHT=weight is not None,
                HAS_BIAS=bias is not None,
                BLOCK=block_for(n_cols),
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
            rows = rows.contiguous()  # the kernels address dy and x with one row stride
        dx = torch.empty_like(dy)
        if n_rows and n_cols:
            layer_norm_backward_input_kernel[(n_rows,)](
                dy,
                rows,
                weight if weight is not None else rows,
                mean,
                rstd,
                dx,
                n_cols,
                n_cols,
                HAS_WEIGHT=weight is not None,
                BLOCK=block_for(n_cols),
            )
        dw = db = None
        want_dw = weight is not None and ctx.needs_input_grad[1]
        want_db = bias is not None and ctx.needs_input_grad[2]
        if want_dw or want_db:
            block = block_for(n_cols, cap=256)
            chunks = max(1, triton.cdiv(n_rows, DW_ROWS_PER_PROGRAM))
            dw_partial = torch.zeros(chunks, n_cols, dtype=torch.float32, device=rows.device)
            db_partial = torch.zeros(chunks, n_cols, dtype=torch.float32, device=rows.device)
            if n_rows and n_cols:
                layer_norm_backward_params_kernel[(triton.cdiv(n_cols, block), chunks)](
                    dy,
                    rows,
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
            if want_dw:
                dw = dw_partial.sum(0).to(weight.dtype)
            if want_db:
                db = db_partial.sum(0).to(bias.dtype)
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
        specs += [
            AotSpec(
                f"layer_norm.forward[{dtype}]",
                layer_norm_forward_kernel,
                {
                    "x_ptr": f"*{dtype}",
                    "w_ptr": f"*{dtype}",
                    "b_ptr": f"*{dtype}",
                    "y_ptr": f"*{dtype}",
                    "mean_ptr": "*fp32",
                    "rstd_ptr": "*fp32",
                    "x_row_stride": "i64",
                    "y_row_stride": "i64",
                    "n_cols": "i32",
                    "eps": "fp32",
                    "HAS_WEIGHT": "constexpr",
                    "HAS_BIAS": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"HAS_WEIGHT": True, "HAS_BIAS": True, "BLOCK": 1024},
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
                {"HAS_WEIGHT": True, "BLOCK": 1024},
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
