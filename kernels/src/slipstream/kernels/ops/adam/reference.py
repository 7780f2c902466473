"""Pure-torch multi-tensor Adam/AdamW step with DeepSpeed FusedAdam semantics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def working_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when fp32/fp64, else an fp32 copy (updated, then rounded once)."""
    # Half-precision tensors are updated in fp32 and rounded once at the end, as FusedAdam's
    # kernel does; fp32/fp64 tensors are updated in place (no copy).
    return tensor.float() if tensor.dtype in _LOW_PRECISION else tensor


def copy_back(original: torch.Tensor, work: torch.Tensor) -> None:
    """Write a working copy made by :func:`working_copy` back into its original (if a copy)."""
    if work is not original:
        original.copy_(work)


def check_lists(
    op: str,
    params: Sequence[torch.Tensor],
    *others: Sequence[torch.Tensor],
    param_copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """Raise ValueError unless the tensor lists have equal lengths and each row equal shapes."""
    lists = (params, *others) + (() if param_copies is None else (param_copies,))
    lengths = [len(tensors) for tensors in lists]
    if len(set(lengths)) > 1:
        raise ValueError(f"{op}: every tensor list must have the same length, got {lengths}")
    for index, row in enumerate(zip(*lists)):
        shapes = [tuple(t.shape) for t in row]
        if len(set(shapes)) > 1:
            raise ValueError(
                f"{op}: tensor {index} has mismatched shapes {shapes} (params, grads, states"
                f"{', copies' if param_copies is not None else ''})"
            )


def adam(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    bias_correction: bool,
    step: int,
    param_copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """One Adam (or AdamW) step over lists of tensors, in place.

    Semantics follow DeepSpeed's ``FusedAdam`` (its ``multi_tensor_adam`` kernel):

    - ``adam_w_mode=False`` (L2 mode, ``torch.optim.Adam``): ``g <- g + weight_decay * p``
      before the moments are updated.
    - ``adam_w_mode=True`` (decoupled, ``torch.optim.AdamW``): ``p <- p - lr * weight_decay * p``
      beside the Adam update, the moments never see the decay.
    - ``m <- beta1 m + (1 - beta1) g``; ``v <- beta2 v + (1 - beta2) g^2``;
      ``p <- p - lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`` with
      ``bc1 = 1 - beta1^step`` and ``bc2 = 1 - beta2^step`` when ``bias_correction``, else 1.

    ``step`` is the step being taken, counted from 1 (the caller increments it first). Grads
    may have a different dtype from their params; fp16/bf16 params and moments are updated
    in fp32 and rounded once. Params with no grad must be left out of the lists.
    ``param_copies``, when given, receive the updated params (for instance the bf16 model
    weights beside fp32 master weights, as in ZeRO-Offload's copy-back).
    """
    count = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == count):
        raise ValueError(
            "adam: params, grads, exp_avgs and exp_avg_sqs must have equal lengths, got "
            f"{count}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}"
        )
    if count == 0:
        return
    if step < 1:
        raise ValueError(f"adam: step must be >= 1 (the step being taken), got {step}")
    for index, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if not (p.shape == g.shape == m.shape == v.shape):
            raise ValueError(
                f"adam: tensor {index} has mismatched shapes: param {tuple(p.shape)}, grad "
                f"{tuple(g.shape)}, exp_avg {tuple(m.shape)}, exp_avg_sq {tuple(v.shape)}"
            )

    bias_correction1 = 1.0 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1.0 - beta2**step if bias_correction else 1.0

    work_params = [working_copy(p) for p in params]
    work_avgs = [working_copy(m) for m in exp_avgs]
    work_avg_sqs = [working_copy(v) for v in exp_avg_sqs]
    work_grads = [g if g.dtype == p.dtype else g.to(p.dtype) for g, p in zip(grads, work_params)]

    with torch.no_grad():
        if not adam_w_mode and weight_decay != 0.0:
            work_grads = list(torch._foreach_add(work_grads, work_params, alpha=weight_decay))
        torch._foreach_mul_(work_avgs, beta1)
        torch._foreach_add_(work_avgs, work_grads, alpha=1.0 - beta1)
        torch._foreach_mul_(work_avg_sqs, beta2)
        torch._foreach_addcmul_(work_avg_sqs, work_grads, work_grads, value=1.0 - beta2)

        denominators = torch._foreach_sqrt(work_avg_sqs)
        torch._foreach_div_(denominators, math.sqrt(bias_correction2))
        torch._foreach_add_(denominators, eps)

        if adam_w_mode and weight_decay != 0.0:
            torch._foreach_mul_(work_params, 1.0 - lr * weight_decay)
        torch._foreach_addcdiv_(work_params, work_avgs, denominators, value=-lr / bias_correction1)

        for originals, working in (
            (params, work_params),
            (exp_avgs, work_avgs),
            (exp_avg_sqs, work_avg_sqs),
        ):
            for original, work in zip(originals, working):
                copy_back(original, work)
        if param_copies is not None:
            check_lists("adam", params, param_copies)
            torch._foreach_copy_(list(param_copies), list(params))
