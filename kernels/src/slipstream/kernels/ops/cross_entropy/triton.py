"""Triton cross-entropy over large vocabularies: logits stream through registers block by block."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.cross_entropy.reference import REDUCTIONS
from slipstream.kernels.triton_support import AotSpec, block_for, check_kernel_device

# Vocabulary elements one program holds in registers at a time.
VOCAB_BLOCK = 4096


@triton.jit
def cross_entropy_forward_kernel(
    logits_ptr,
    target_ptr,
    loss_ptr,
    lse_ptr,
    row_stride,
    n_cols,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """One program per token: an online log-sum-exp over the vocabulary, then ``lse - z[target]``.

    Stores the fp32 loss (0 for ignored tokens) and the fp32 log-sum-exp that backward needs.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    run_max = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, z)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(z - safe)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)
    picked = tl.load(row_ptr + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def cross_entropy_backward_kernel(
    logits_ptr,
    target_ptr,
    lse_ptr,
    scale_ptr,
    grad_ptr,
    row_stride,
    grad_row_stride,
    n_cols,
    ignore_index,
    BLOCK: tl.constexpr,
):
    """One program per token: ``grad = scale * (softmax(z) - onehot(target))`` in logits' dtype.

    ``scale`` is read from device memory (``grad_output / count``) so no host sync is needed.
    """
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row)
    valid = target != ignore_index
    scale = tl.load(scale_ptr)
    scale = tl.where(valid, scale, 0.0)
    lse = tl.load(lse_ptr + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(logits_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)
        grad = grad * scale
        tl.store(
            grad_ptr + row * grad_row_stride + cols,
            grad.to(grad_ptr.dtype.element_ty),
            mask=mask,
        )


class TritonCrossEntropy(torch.autograd.Function):
    """Autograd wrapper: saves the logits (as given) and one fp32 log-sum-exp per token."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str
    ) -> torch.Tensor:
        tokens, vocab = logits.shape
        losses = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        lse = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        block = block_for(vocab, cap=VOCAB_BLOCK)
        if tokens:
            cross_entropy_forward_kernel[(tokens,)](
                logits, target, losses, lse, logits.stride(0), vocab, ignore_index, BLOCK=block
            )
        # Kept on device: dividing by a tensor count avoids a CPU-GPU sync for .item().
        count = (target != ignore_index).sum().to(torch.float32)
        total = losses.sum()
        loss = total / count if reduction == "mean" else total
        ctx.save_for_backward(logits, target, lse, count)
        ctx.ignore_index = ignore_index
        ctx.reduction = reduction
        return loss.to(logits.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        logits, target, lse, count = ctx.saved_tensors
        tokens, vocab = logits.shape
        scale = grad_output.float().reshape(1)
        if ctx.reduction == "mean":
            scale = scale / count
        # Written straight in logits' dtype: no fp32 (tokens x vocab) buffer ever exists.
        grad = torch.empty((tokens, vocab), dtype=logits.dtype, device=logits.device)
        if tokens:
            cross_entropy_backward_kernel[(tokens,)](
                logits,
                target,
                lse,
                scale,
                grad,
                logits.stride(0),
                grad.stride(0),
                vocab,
                ctx.ignore_index,
                BLOCK=block_for(vocab, cap=VOCAB_BLOCK),
            )
        return grad, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Triton cross-entropy with the semantics of :func:`..reference.cross_entropy`.

    Each token's logits are read in vocabulary blocks of up to 4096 elements and upcast in
    registers, so neither fp32 logits nor an fp32 gradient of the logits' size is ever
    allocated; ``chunk_size`` (the reference's token chunking) is validated and otherwise has
    nothing to control here. Targets outside ``[0, vocab)`` other than ``ignore_index`` are
    an error, checked on the host only when the logits are on the CPU (a device check would
    cost a sync); on a GPU they read out-of-range memory, as in ``F.cross_entropy``'s kernels.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logits.dim() < 1 or logits.shape[:-1] != target.shape:
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be target's shape "
            f"{tuple(target.shape)} plus a trailing vocabulary dimension"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise TypeError(
            f"cross_entropy: target must hold integer class indices, got dtype {target.dtype}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"cross_entropy: chunk_size must be >= 1 tokens, got {chunk_size}")
    check_kernel_device("cross_entropy", logits, target)
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    if vocab > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    targets = target.reshape(-1).long().contiguous()
    if rows.device.type == "cpu":
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
        if bool(bad.any()):
            raise ValueError(
                f"cross_entropy: target holds class indices outside [0, {vocab}) that are not "
                f"ignore_index={ignore_index}"
            )
    return TritonCrossEntropy.apply(rows, targets, int(ignore_index), reduction)  # type: ignore[no-any-return]


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("fp32", "bf16", "fp16"):
        specs.append(
            AotSpec(
                f"cross_entropy.forward[{dtype}]",
                cross_entropy_forward_kernel,
                {
                    "logits_ptr": f"*{dtype}",
                    "target_ptr": "*i64",
                    "loss_ptr": "*fp32",
                    "lse_ptr": "*fp32",
                    "row_stride": "i64",
                    "n_cols": "i32",
                    "ignore_index": "i64",
                    "BLOCK": "constexpr",
                },
                {"BLOCK": VOCAB_BLOCK},
            )
        )
        specs.append(
            AotSpec(
                f"cross_entropy.backward[{dtype}]",
                cross_entropy_backward_kernel,
                {
                    "logits_ptr": f"*{dtype}",
                    "target_ptr": "*i64",
                    "lse_ptr": "*fp32",
                    "scale_ptr": "*fp32",
                    "grad_ptr": f"*{dtype}",
                    "row_stride": "i64",
                    "grad_row_stride": "i64",
                    "n_cols": "i32",
                    "ignore_index": "i64",
                    "BLOCK": "constexpr",
                },
                {"BLOCK": VOCAB_BLOCK},
            )
        )
    return specs
