"""Triton residual add + RMSNorm: one program per row, the row read once, both results written."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.add_rms_norm.reference import add_rms_norm as reference
from slipstream.kernels.triton_support import AotSpec, check_kernel_device, next_power_of_2

MAX_COLUMNS = 32768  # a row lives in registers


@triton.jit
def add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    total_ptr,
    y_ptr,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``total = round(x + r)``; ``y = total * rsqrt(mean(total^2) + eps) * w`` in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * n_cols + cols, mask=keep, other=0.0).to(tl.float32)
    total = (x + r).to(total_ptr.dtype.element_ty)  # rounded as torch's add rounds it
    tl.store(total_ptr + row * n_cols + cols, total, mask=keep)
    t = total.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(t * t, axis=0) / n_cols + eps)
    y = t * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=keep)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`slipstream.kernels.ops.add_rms_norm.reference.add_rms_norm`."""
    check_kernel_device("add_rms_norm", x, residual, weight)
    columns = x.shape[-1]
    if (
        x.shape != residual.shape
        or x.dtype != residual.dtype
        or columns > MAX_COLUMNS
        or (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad))
    ):
        return reference(x, residual, weight, eps)  # shape errors, mixed dtypes, training
    x, residual = x.contiguous(), residual.contiguous()
    total, y = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // max(columns, 1)
    if rows:
        add_rms_norm_kernel[(rows,)](
            x,
            residual,
            weight if weight is not None else x,
            total,
            y,
            columns,
            eps,
            HAS_WEIGHT=weight is not None,
            BLOCK=max(16, next_power_of_2(columns)),
            num_warps=8 if columns >= 4096 else 4,
        )
    return total, y


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    return [
        AotSpec(
            f"add_rms_norm[{dtype}]",
            add_rms_norm_kernel,
            {
                "x_ptr": f"*{dtype}",
                "r_ptr": f"*{dtype}",
                "w_ptr": f"*{dtype}",
                "total_ptr": f"*{dtype}",
                "y_ptr": f"*{dtype}",
                "n_cols": "i32",
                "eps": "fp32",
                "HAS_WEIGHT": "constexpr",
                "BLOCK": "constexpr",
            },
            {"HAS_WEIGHT": True, "BLOCK": 4096},
        )
        for dtype in ("bf16", "fp16", "fp32")
    ]
