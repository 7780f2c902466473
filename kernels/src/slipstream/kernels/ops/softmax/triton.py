"""Triton attention-score softmax with scale, boolean/additive mask and bottom-right causal mask."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import AotSpec, block_for, check_kernel_device

MASK_NONE, MASK_BOOL, MASK_ADDITIVE = 0, 1, 2


@triton.jit
def _masked_logits(
    s_row,
    m_row,
    cols,
    n_cols,
    query,
    n_queries,
    scale,
    mask_col_stride,
    MASK_KIND: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    in_row = cols < n_cols
    z = tl.load(s_row + cols, mask=in_row, other=0.0).to(tl.float32) * scale
    keep = in_row
    if MASK_KIND == 1:
        keep = keep & (tl.load(m_row + cols * mask_col_stride, mask=in_row, other=0) != 0)
    if MASK_KIND == 2:
        z = z + tl.load(m_row + cols * mask_col_stride, mask=in_row, other=0.0).to(tl.float32)
    if CAUSAL:
        # Bottom-right aligned: query i sees keys j <= i + keys - queries.
        keep = keep & (cols <= query + n_cols - n_queries)
    return tl.where(keep, z, float("-inf"))


@triton.jit
def softmax_forward_kernel(
    s_ptr,
    m_ptr,
    y_ptr,
    n_cols,
    n_queries,
    n_heads,
    scale,
    mask_stride_b,
    mask_stride_h,
    mask_stride_q,
    mask_stride_k,
    MASK_KIND: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row of a contiguous ``(batch, heads, queries, keys)`` score tensor.

    The mask is addressed through its own (broadcast, possibly zero) strides, so a
    ``(1, 1, q, k)`` or ``(b, 1, 1, k)`` mask is never expanded in memory.
    """
    row = tl.program_id(0).to(tl.int64)
    query = row % n_queries
    head = (row // n_queries) % n_heads
    batch = row // (n_queries * n_heads)
    s_row = s_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    m_row = m_ptr + batch * mask_stride_b + head * mask_stride_h + query * mask_stride_q
    # Online pass: running per-lane maximum and rescaled sum, so each score is read twice
    # (here and in the write pass) whatever the row length.
    run_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _masked_logits(
            s_row, m_row, cols, n_cols, query, n_queries, scale, mask_stride_k, MASK_KIND, CAUSAL
        )
        new_max = tl.maximum(run_max, z)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(z - safe)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    # A fully masked row has maximum -inf: use 0 so exp(-inf) = 0 and the row comes out zeros.
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(run_sum * tl.exp(run_max - safe_max), axis=0)
    # Fully masked rows have total 0 and every exp() is 0 already: divide by 1 instead.
    inverse = 1.0 / tl.where(total == 0.0, 1.0, total)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _masked_logits(
            s_row, m_row, cols, n_cols, query, n_queries, scale, mask_stride_k, MASK_KIND, CAUSAL
        )
        y = tl.exp(z - safe_max) * inverse
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def softmax_backward_kernel(
    y_ptr,
    dy_ptr,
    dx_ptr,
    n_cols,
    scale,
    BLOCK: tl.constexpr,
):
    """One program per row: ``dx = scale * y * (dy - sum(dy * y))`` (masked entries have y = 0)."""
    row = tl.program_id(0).to(tl.int64)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dot += y * dy
    total = tl.sum(dot, axis=0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(y_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dx = scale * y * (dy - total)
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _as_four_dims(scores: torch.Tensor) -> torch.Tensor:
    if scores.dim() > 4:
        return scores.reshape(-1, *scores.shape[-3:])
    return scores.reshape((1,) * (4 - scores.dim()) + tuple(scores.shape))


def _mask_operand(
    mask: torch.Tensor, scores_shape: torch.Size, four: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int, int, int], int]:
    try:
        expanded = mask.expand(scores_shape)  # a view with zero strides where it broadcasts
    except RuntimeError as exc:
        raise ValueError(
            f"softmax: mask of shape {tuple(mask.shape)} does not broadcast to the scores' "
            f"shape {tuple(scores_shape)}"
        ) from exc
    if len(scores_shape) > 4:
        expanded = expanded.reshape(four.shape)  # may copy: > 4-D masks are rare
    else:
        expanded = expanded.reshape(four.shape) if expanded.dim() != 4 else expanded
    if mask.dtype == torch.bool:
        return expanded.view(torch.uint8), tuple(expanded.stride()), MASK_BOOL  # type: ignore[return-value]
    if not mask.dtype.is_floating_point:
        raise TypeError(
            f"softmax: mask must be boolean (True = keep) or floating point (additive), got "
            f"{mask.dtype}"
        )
    return expanded, tuple(expanded.stride()), MASK_ADDITIVE  # type: ignore[return-value]


class TritonSoftmax(torch.autograd.Function):
    """Autograd wrapper: forward saves only the probabilities; backward is one fused pass."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        scores: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        shape = scores.shape
        four = _as_four_dims(scores.contiguous())
        batch, heads, queries, keys = four.shape
        out = torch.empty_like(four)
        if mask is not None:
            mask_arg, strides, kind = _mask_operand(mask, shape, four)
        else:
            mask_arg, strides, kind = four, (0, 0, 0, 0), MASK_NONE
        rows = batch * heads * queries
        if rows and keys:
            softmax_forward_kernel[(rows,)](
                four,
                mask_arg,
                out,
                keys,
                queries,
                heads,
                scale,
                *strides,
                MASK_KIND=kind,
                CAUSAL=causal,
                BLOCK=block_for(keys),
            )
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out.reshape(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (probabilities,) = ctx.saved_tensors
        keys = probabilities.shape[-1]
        dy = grad_out.reshape(probabilities.shape).contiguous()
        dx = torch.empty_like(probabilities)
        rows = probabilities.numel() // max(keys, 1)
        if rows and keys:
            softmax_backward_kernel[(rows,)](
                probabilities, dy, dx, keys, ctx.scale, BLOCK=block_for(keys)
            )
        return dx.reshape(grad_out.shape), None, None, None


def softmax(
    scores: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton softmax with the semantics of :func:`..reference.softmax`.

    Differentiable in ``scores``; an additive ``mask`` that requires grad is refused (its
    gradient is not computed here; use the reference backend for that).
    """
    if causal and scores.dim() < 2:
        raise ValueError(
            f"softmax: causal masking needs (..., queries, keys) scores, got shape "
            f"{tuple(scores.shape)}"
        )
    if mask is not None and mask.requires_grad:
        raise ValueError(
            "softmax (triton): the additive mask requires grad, but this backend does not "
            "differentiate the mask; detach it or force SLIPSTREAM_OP_BACKEND=softmax=reference"
        )
    check_kernel_device("softmax", scores, mask)
    scale_value = 1.0 if scale is None else float(scale)
    return TritonSoftmax.apply(scores, scale_value, bool(causal), mask)  # type: ignore[no-any-return]


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("fp32", "bf16", "fp16"):
        for kind, mask_type, causal in (
            (MASK_NONE, f"*{dtype}", True),
            (MASK_BOOL, "*u8", False),
            (MASK_ADDITIVE, "*fp32", False),
        ):
            specs.append(
                AotSpec(
                    f"softmax.forward[{dtype},mask={kind},causal={causal}]",
                    softmax_forward_kernel,
                    {
                        "s_ptr": f"*{dtype}",
                        "m_ptr": mask_type,
                        "y_ptr": f"*{dtype}",
                        "n_cols": "i32",
                        "n_queries": "i32",
                        "n_heads": "i32",
                        "scale": "fp32",
                        "mask_stride_b": "i64",
                        "mask_stride_h": "i64",
                        "mask_stride_q": "i64",
                        "mask_stride_k": "i64",
                        "MASK_KIND": "constexpr",
                        "CAUSAL": "constexpr",
                        "BLOCK": "constexpr",
                    },
                    {"MASK_KIND": kind, "CAUSAL": causal, "BLOCK": 1024},
                )
            )
        specs.append(
            AotSpec(
                f"softmax.backward[{dtype}]",
                softmax_backward_kernel,
                {
                    "y_ptr": f"*{dtype}",
                    "dy_ptr": f"*{dtype}",
                    "dx_ptr": f"*{dtype}",
                    "n_cols": "i32",
                    "scale": "fp32",
                    "BLOCK": "constexpr",
                },
                {"BLOCK": 1024},
            )
        )
    return specs
