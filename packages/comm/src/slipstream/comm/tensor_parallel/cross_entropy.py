"""Cross-entropy over vocabulary-parallel logits, without gathering the full vocabulary.

Each rank holds the logits of its vocabulary slice (the output of a column-parallel LM head
without ``gather_output``). The softmax's max and denominator and the target's logit are
combined with three all-reduces of one value per token, so no rank ever holds
``[tokens, vocab]``; the gradient (``softmax - one_hot``) is computed locally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.comm.tensor_parallel.mappings import (
    tensor_parallel_rank,
    tensor_parallel_world_size,
)

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: Any,
        ignore_index: int,
    ) -> torch.Tensor:
        world = tensor_parallel_world_size(group)
        per_rank = logits.shape[-1]
        start = tensor_parallel_rank(group) * per_rank
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        if world > 1:
            collectives.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == ignore_index
        outside = (target < start) | (target >= start + per_rank) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        flat = shifted.reshape(-1, per_rank)
        rows = torch.arange(flat.shape[0], device=flat.device)
        target_logit = flat[rows, local_target.reshape(-1)].reshape(target.shape)
        target_logit = target_logit.masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            # Two reductions of one value per token; the logits themselves never move.
            collectives.all_reduce(target_logit, group=group)
            collectives.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, ignored, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, outside, ignored, local_target = ctx.saved_tensors
        per_rank = softmax.shape[-1]
        grad_input = softmax.clone().reshape(-1, per_rank)
        rows = torch.arange(grad_input.shape[0], device=grad_input.device)
        grad_input[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).to(grad_input.dtype)
        grad_input = grad_input.reshape(softmax.shape)
        scale = grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad_input * scale, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` over logits split along the vocabulary across ``group``.

    Args:
        logits: ``[..., vocab / tp]``, this rank's slice of the vocabulary (rank ``r`` holds
            ids ``r * vocab/tp`` to ``(r + 1) * vocab/tp``, as :class:`ColumnParallelLinear`
            and :class:`VocabParallelEmbedding` split it).
        target: ``[...]`` class ids into the whole vocabulary.
        group: the tensor-parallel group (None: the logits are the whole vocabulary).
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored targets), ``"sum"`` or ``"none"``.

    Computed in fp32 whatever the logits' dtype; the result is fp32.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree: the "
            "logits must be the target's shape plus a last (vocabulary) dimension"
        )
    losses = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)
    if reduction == "none":
        return losses  # type: ignore[no-any-return]
    if reduction == "sum":
        return losses.sum()  # type: ignore[no-any-return]
    if reduction == "mean":
        count = (target != ignore_index).sum()
        return losses.sum() / count  # type: ignore[no-any-return]
    raise ValueError(f"reduction={reduction!r}; use 'mean', 'sum' or 'none'")
