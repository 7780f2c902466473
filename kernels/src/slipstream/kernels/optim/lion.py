"""Lion with DeepSpeed ``FusedLion`` semantics, in plain PyTorch (the reference for fused kernels)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from slipstream.kernels.optim._validation import check_betas, check_non_negative

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """EvoLved Sign Momentum (Lion, https://arxiv.org/abs/2302.06675).

    Per parameter, with ``g`` its gradient and ``w`` its weights::

        c = beta1 * m + (1 - beta1) * g
        w = w * (1 - lr * weight_decay) - lr * sign(c)      # decoupled weight decay
        m = beta2 * m + (1 - beta2) * g

    Defaults are DeepSpeed's (``lr=1e-3``, ``betas=(0.9, 0.999)``); the paper recommends
    ``betas=(0.9, 0.99)`` and a learning rate 3-10x smaller than AdamW's. The momentum has
    the parameter's dtype, as in DeepSpeed; fp16/bf16 parameters are updated in fp32 and
    written back. Where ``c`` is exactly 0 the sign is 0 (no move), as in the paper;
    DeepSpeed's CUDA kernel moves such elements by ``+lr``.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate (the size of every element's step).
        betas: interpolation weight of the update direction, and decay of the momentum.
        weight_decay: decoupled weight decay coefficient.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        check_non_negative("lr", lr)
        check_non_negative("weight_decay", weight_decay)
        betas = check_betas(betas)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one Lion update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                raw_grad = param.grad
                if raw_grad is None:
                    continue
                if raw_grad.is_sparse:
                    raise RuntimeError(
                        "Lion does not support sparse gradients; use a dense embedding "
                        "(sparse=False) or torch.optim.SparseAdam for that parameter"
                    )
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1

                compute_dtype = (
                    param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32
                )
                # For fp32/fp64 tensors `.to` returns the tensor itself, updated in place below.
                weight = param.to(compute_dtype)
                exp_avg = state["exp_avg"].to(compute_dtype)
                grad = raw_grad.to(compute_dtype)

                direction = (exp_avg * beta1).add_(grad, alpha=1.0 - beta1).sign_()
                if weight_decay != 0:
                    weight.mul_(1.0 - lr * weight_decay)
                weight.add_(direction, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)

                if weight is not param:
                    param.copy_(weight)
                if exp_avg is not state["exp_avg"]:
                    state["exp_avg"].copy_(exp_avg)
        return loss
