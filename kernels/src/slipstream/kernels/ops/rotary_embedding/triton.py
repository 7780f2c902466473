"""Triton rotary position embedding (GPT-NeoX and GPT-J layouts), forward and backward."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import AotSpec, check_kernel_device, next_power_of_2


@triton.jit
def rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    head_dim,
    half,
    size1,
    size2,
    table_stride0,
    table_stride1,
    table_stride2,
    table_stride_col,
    sin_sign,
    INTERLEAVED: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """One program per row of a contiguous ``(d0, d1, d2, head_dim)`` input.

    ``cos``/``sin`` are read through broadcast strides (zero along broadcast dims), so the
    ``(seq, 1, half)`` tables are never expanded to the input's size. ``sin_sign = -1`` rotates
    by the opposite angle, which is the backward pass (the rotation is orthogonal).
    """
    row = tl.program_id(0).to(tl.int64)
    i2 = row % size2
    i1 = (row // size2) % size1
    i0 = row // (size1 * size2)
    table_row = i0 * table_stride0 + i1 * table_stride1 + i2 * table_stride2
    x_row = x_ptr + row * head_dim
    y_row = y_ptr + row * head_dim
    pairs = tl.arange(0, BLOCK_HALF)
    in_half = pairs < half
    cos = tl.load(cos_ptr + table_row + pairs * table_stride_col, mask=in_half, other=1.0)
    sin = tl.load(sin_ptr + table_row + pairs * table_stride_col, mask=in_half, other=0.0)
    cos = cos.to(tl.float32)
    sin = sin.to(tl.float32) * sin_sign
    if INTERLEAVED:
        first_cols = 2 * pairs
        second_cols = 2 * pairs + 1
    else:
        first_cols = pairs
        second_cols = pairs + half
    first = tl.load(x_row + first_cols, mask=in_half, other=0.0).to(tl.float32)
    second = tl.load(x_row + second_cols, mask=in_half, other=0.0).to(tl.float32)
    out_first = first * cos - second * sin
    out_second = second * cos + first * sin
    tl.store(y_row + first_cols, out_first.to(y_ptr.dtype.element_ty), mask=in_half)
    tl.store(y_row + second_cols, out_second.to(y_ptr.dtype.element_ty), mask=in_half)
    # Features past rotary_dim pass through unchanged (partial rotary).
    for start in range(2 * half, head_dim, BLOCK_PASS):
        cols = start + tl.arange(0, BLOCK_PASS)
        keep = cols < head_dim
        tl.store(y_row + cols, tl.load(x_row + cols, mask=keep), mask=keep)


def _tables_as_strides(
    table: torch.Tensor, lead_shape: tuple[int, ...]
) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    half = table.shape[-1]
    try:
        expanded = table.expand(*lead_shape, half)  # zero strides where it broadcasts: no copy
    except RuntimeError as exc:
        raise ValueError(
            f"rotary_embedding: cos/sin of shape {tuple(table.shape)} do not broadcast against "
            f"x's leading dimensions {lead_shape} plus ({half},)"
        ) from exc
    if len(lead_shape) > 3:
        expanded = expanded.reshape(-1, *lead_shape[-2:], half)  # may copy: > 4-D x is rare
    else:
        expanded = expanded.reshape((1,) * (3 - len(lead_shape)) + lead_shape + (half,))
    return expanded, tuple(expanded.stride())  # type: ignore[return-value]


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, sign: float
) -> torch.Tensor:
    head_dim = x.shape[-1]
    half = cos.shape[-1]
    lead_shape = tuple(x.shape[:-1])
    x_c = x.contiguous()
    out = torch.empty_like(x_c)
    cos_e, strides = _tables_as_strides(cos, lead_shape)
    sin_e, sin_strides = _tables_as_strides(sin, lead_shape)
    if sin_strides != strides:
        sin_e = sin_e.contiguous()  # cos and sin are addressed with one set of strides
        cos_e = cos_e.contiguous()
        strides = tuple(cos_e.stride())  # type: ignore[assignment]
    size1, size2 = cos_e.shape[1], cos_e.shape[2]
    rows = x_c.numel() // max(head_dim, 1)
    if rows and half:
        rotary_kernel[(rows,)](
            x_c,
            cos_e,
            sin_e,
            out,
            head_dim,
            half,
            size1,
            size2,
            *strides,
            sign,
            INTERLEAVED=interleaved,
            BLOCK_HALF=next_power_of_2(half),
            BLOCK_PASS=max(16, min(next_power_of_2(head_dim - 2 * half), 1024)),
        )
    elif rows:
        out.copy_(x_c)
    return out


class TritonRotary(torch.autograd.Function):
    """Autograd wrapper: the backward rotates the gradient by the opposite angles."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate(x, cos, sin, interleaved, 1.0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(grad_out, cos, sin, ctx.interleaved, -1.0), None, None, None


def rotary_embedding(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Triton RoPE with the semantics of :func:`..reference.rotary_embedding`.

    Differentiable in ``x``; the cos/sin tables are constants here (a table that requires
    grad is refused: use the reference backend to differentiate through it).
    """
    if cos.shape != sin.shape:
        raise ValueError(
            f"rotary_embedding: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have "
            "the same shape"
        )
    half = cos.shape[-1]
    if 2 * half > x.shape[-1]:
        raise ValueError(
            f"rotary_embedding: cos/sin cover {2 * half} features (2 * {half}) but x has only "
            f"{x.shape[-1]} in its last dimension"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "rotary_embedding (triton): cos/sin require grad, but this backend treats them as "
            "constants; detach them or force SLIPSTREAM_OP_BACKEND=rotary_embedding=reference"
        )
    check_kernel_device("rotary_embedding", x, cos, sin)
    return TritonRotary.apply(x, cos, sin, bool(interleaved))  # type: ignore[no-any-return]


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("fp32", "bf16", "fp16"):
        for interleaved in (False, True):
            specs.append(
                AotSpec(
                    f"rotary_embedding[{dtype},interleaved={interleaved}]",
                    rotary_kernel,
                    {
                        "x_ptr": f"*{dtype}",
                        "cos_ptr": "*fp32",
                        "sin_ptr": "*fp32",
                        "y_ptr": f"*{dtype}",
                        "head_dim": "i32",
                        "half": "i32",
                        "size1": "i32",
                        "size2": "i32",
                        "table_stride0": "i64",
                        "table_stride1": "i64",
                        "table_stride2": "i64",
                        "table_stride_col": "i64",
                        "sin_sign": "fp32",
                        "INTERLEAVED": "constexpr",
                        "BLOCK_HALF": "constexpr",
                        "BLOCK_PASS": "constexpr",
                    },
                    {"INTERLEAVED": interleaved, "BLOCK_HALF": 64, "BLOCK_PASS": 16},
                )
            )
    return specs
