"""Pure-torch cross-entropy, chunked over tokens so fp32 logits are never materialised whole."""

from __future__ import annotations

from typing import Any

import torch

# Elements of one fp32 chunk (128 MiB): big enough to keep kernels busy, small next to the
# (tokens x vocabulary) logits of a large model.
DEFAULT_CHUNK_ELEMENTS = 1 << 25
REDUCTIONS = ("mean", "sum")


def _chunk_rows(vocab_size: int, chunk_size: int | None) -> int:
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab_size, 1))
    if chunk_size < 1:
        raise ValueError(f"cross_entropy: chunk_size must be >= 1 tokens, got {chunk_size}")
    return chunk_size


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward and backward both walk the tokens in chunks, upcasting one chunk at a time.

    Only the per-token log-sum-exp (one fp32 per token) is saved for backward; the softmax is
    recomputed chunk by chunk there and written straight into the gradient in logits' dtype.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        rows_per_chunk: int,
        reduction: str,
    ) -> torch.Tensor:
        tokens = logits.shape[0]
        valid = target != ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        log_sum_exp = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, tokens, rows_per_chunk):
            end = min(start + rows_per_chunk, tokens)
            chunk = logits[start:end].float()
            chunk_lse = torch.logsumexp(chunk, dim=-1)
            log_sum_exp[start:end] = chunk_lse
            picked = chunk.gather(1, safe_target[start:end, None]).squeeze(1)
            losses = torch.where(valid[start:end], chunk_lse - picked, 0.0)
            total = total + losses.sum()
        # Kept on the device: dividing by a tensor count avoids a CPU-GPU sync for .item().
        count = valid.sum().to(torch.float32)
        loss = total / count if reduction == "mean" else total
        ctx.save_for_backward(logits, safe_target, valid, log_sum_exp, count)
        ctx.rows_per_chunk = rows_per_chunk
        ctx.reduction = reduction
        return loss.to(logits.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        logits, safe_target, valid, log_sum_exp, count = ctx.saved_tensors
        scale = grad_output.float()
        if ctx.reduction == "mean":
            scale = scale / count
        grad_logits = torch.empty_like(logits)
        tokens = logits.shape[0]
        for start in range(0, tokens, ctx.rows_per_chunk):
            end = min(start + ctx.rows_per_chunk, tokens)
            probabilities = torch.exp(logits[start:end].float() - log_sum_exp[start:end, None])
            probabilities.scatter_add_(
                1,
                safe_target[start:end, None],
                torch.full((end - start, 1), -1.0, device=logits.device),
            )
            probabilities = torch.where(valid[start:end, None], probabilities * scale, 0.0)
            grad_logits[start:end] = probabilities
        return grad_logits, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits`` (``(..., vocab)``) against class indices ``target`` (``(...)``).

    Equal to ``F.cross_entropy(logits.reshape(-1, V).float(), target.reshape(-1),
    ignore_index=ignore_index, reduction=reduction)`` (returned in ``logits.dtype``), but the
    fp32 upcast is done ``chunk_size`` tokens at a time (default: about 2**25 elements per
    chunk), in forward and in backward. The class dimension is the last one (unlike
    ``F.cross_entropy``, whose class dimension is 1). ``"mean"`` divides by the number of
    tokens whose target is not ``ignore_index``; when every token is ignored it is NaN, as
    in PyTorch.
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
    vocab_size = logits.shape[-1]
    logits_2d = logits.reshape(-1, vocab_size)
    target_1d = target.reshape(-1).long()
    rows = _chunk_rows(vocab_size, chunk_size)
    result = _ChunkedCrossEntropy.apply(logits_2d, target_1d, ignore_index, rows, reduction)
    return result  # type: ignore[no-any-return]
