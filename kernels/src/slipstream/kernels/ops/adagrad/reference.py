"""Pure-torch multi-tensor Adagrad step (DeepSpeed ``DeepSpeedCPUAdagrad`` semantics)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.kernels.ops.adam.reference import check_lists, copy_back, working_copy


def adagrad(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    param_copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """One Adagrad step over lists of tensors, in place.

    ``g <- g + weight_decay * p``; ``s <- s + g^2``; ``p <- p - lr * g / (sqrt(s) + eps)``:
    ``torch.optim.Adagrad`` with ``lr_decay=0`` and ``initial_accumulator_value=0``. fp16/bf16
    tensors are updated in fp32 and rounded once; ``param_copies``, when given, receive the
    updated params.
    """
    check_lists("adagrad", params, grads, exp_avg_sqs, param_copies=param_copies)
    with torch.no_grad():
        for index, (p, g, s) in enumerate(zip(params, grads, exp_avg_sqs)):
            weight, sum_sq = working_copy(p), working_copy(s)
            grad = g.to(weight.dtype)
            if weight_decay != 0:
                grad = grad.add(weight, alpha=weight_decay)
            sum_sq.addcmul_(grad, grad, value=1.0)
            weight.addcdiv_(grad, sum_sq.sqrt().add_(eps), value=-lr)
            copy_back(p, weight)
            copy_back(s, sum_sq)
            if param_copies is not None:
                param_copies[index].copy_(p)
