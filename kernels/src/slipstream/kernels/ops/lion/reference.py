"""Pure-torch multi-tensor Lion step (the functional form of :class:`slipstream.kernels.optim.Lion`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.kernels.ops.adam.reference import check_lists, copy_back, working_copy


def lion(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    param_copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """One Lion step over lists of tensors, in place (DeepSpeed ``FusedLion`` semantics).

    ``c = beta1 m + (1 - beta1) g``; ``p <- p (1 - lr wd) - lr sign(c)`` (sign(0) = 0);
    ``m <- beta2 m + (1 - beta2) g``. fp16/bf16 tensors are updated in fp32 and rounded once.
    ``param_copies``, when given, receive the updated params (e.g. bf16 copies of fp32 masters).
    """
    check_lists("lion", params, grads, exp_avgs, param_copies=param_copies)
    with torch.no_grad():
        for index, (p, g, m) in enumerate(zip(params, grads, exp_avgs)):
            weight, momentum = working_copy(p), working_copy(m)
            grad = g.to(weight.dtype)
            direction = (momentum * beta1).add_(grad, alpha=1.0 - beta1).sign_()
            if weight_decay != 0:
                weight.mul_(1.0 - lr * weight_decay)
            weight.add_(direction, alpha=-lr)
            momentum.mul_(beta2).add_(grad, alpha=1.0 - beta2)
            copy_back(p, weight)
            copy_back(m, momentum)
            if param_copies is not None:
                param_copies[index].copy_(p)
