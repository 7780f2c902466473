"""Pure-torch multi-tensor LAMB step (the functional form of :class:`slipstream.kernels.optim.Lamb`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from slipstream.kernels.ops.adam.reference import check_lists, copy_back, working_copy


def lamb(
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
    bias_correction: bool,
    step: int,
    eps_inside_sqrt: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
) -> torch.Tensor:
    """One LAMB step over lists of tensors, in place; returns the fp32 trust ratios (one each).

    Per tensor (DeepSpeed ``FusedLamb`` semantics, as :class:`~slipstream.kernels.optim.Lamb`)::

        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        update = m / (sqrt(v) + eps) + weight_decay * w      # sqrt(v + eps) if eps_inside_sqrt
        trust = clamp(||w|| / ||update||, min_coeff, max_coeff), or 1 if either norm is 0
        w = w - lr * sqrt(1 - beta2^step) / (1 - beta1^step) * trust * update

    (``lr`` alone without ``bias_correction``). fp16/bf16 tensors are computed in fp32.
    """
    check_lists("lamb", params, grads, exp_avgs, exp_avg_sqs)
    if step < 1:
        raise ValueError(f"lamb: step must be >= 1 (the step being taken), got {step}")
    if bias_correction:
        step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    else:
        step_size = lr
    ratios = []
    with torch.no_grad():
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            weight, avg, avg_sq = working_copy(p), working_copy(m), working_copy(v)
            grad = g.to(weight.dtype)
            avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
            avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            if eps_inside_sqrt:
                denominator = (avg_sq + eps).sqrt()
            else:
                denominator = avg_sq.sqrt() + eps
            update = avg / denominator
            if weight_decay != 0:
                update.add_(weight, alpha=weight_decay)
            weight_norm = torch.linalg.vector_norm(weight.float())
            update_norm = torch.linalg.vector_norm(update.float())
            ratio = (weight_norm / update_norm).clamp(min_coeff, max_coeff)
            trust = torch.where(
                (weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio)
            )
            weight.add_(update * trust.to(update.dtype), alpha=-step_size)
            copy_back(p, weight)
            copy_back(m, avg)
            copy_back(v, avg_sq)
            ratios.append(trust)
    if not ratios:
        return torch.empty(0)
    return torch.stack(ratios)
