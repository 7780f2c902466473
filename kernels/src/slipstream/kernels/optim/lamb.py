"""LAMB with DeepSpeed ``FusedLamb`` semantics, in plain PyTorch (the reference for fused kernels)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from slipstream.kernels.optim._validation import check_betas, check_non_negative

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (LAMB, https://arxiv.org/abs/1904.00962) as DeepSpeed computes it.

    Per parameter tensor, with ``g`` its gradient, ``w`` its weights and ``t`` its step count::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = m / (sqrt(v) + eps) + weight_decay * w       # sqrt(v + eps) if eps_inside_sqrt
        trust = clamp(||w|| / ||update||, min_coeff, max_coeff), or 1 if either norm is 0
        step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)   # lr without bias_correction
        w = w - step_size * trust * update

    As in DeepSpeed, bias correction scales the step size rather than ``m`` and ``v``, so the
    trust ratio is computed from the uncorrected moments. Weight decay is part of the update
    (and so of the trust ratio), as in the LAMB paper. The trust ratios of the last step stay
    on device (:attr:`lamb_coeffs`); :meth:`get_lamb_coeffs` copies them to the host.

    fp16/bf16 parameters keep fp32 moments and are updated in fp32, then written back.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate.
        bias_correction: apply Adam's bias correction through the step size.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        eps_inside_sqrt: use ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``.
        weight_decay: coefficient of the weights added to the update.
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        check_non_negative("lr", lr)
        check_non_negative("eps", eps)
        check_non_negative("weight_decay", weight_decay)
        betas = check_betas(betas)
        check_non_negative("min_coeff", min_coeff)
        if max_coeff < min_coeff:
            raise ValueError(f"max_coeff ({max_coeff!r}) must be >= min_coeff ({min_coeff!r})")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one LAMB update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(
                        "Lamb does not support sparse gradients; use a dense embedding "
                        "(sparse=False) or torch.optim.SparseAdam for that parameter"
                    )
                self.lamb_coeffs.append(self._update(param, grad, group))
        return loss

    def _update(
        self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        compute_dtype = (
            param.dtype if param.dtype in (torch.float32, torch.float64) else torch.float32
        )
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(
                param, dtype=compute_dtype, memory_format=torch.preserve_format
            )
            state["exp_avg_sq"] = torch.zeros_like(
                param, dtype=compute_dtype, memory_format=torch.preserve_format
            )
        state["step"] += 1
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

        # For fp32/fp64 parameters `.to` returns the parameter itself, updated in place below.
        weight = param.to(compute_dtype)
        grad = grad.to(compute_dtype)
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        if group["eps_inside_sqrt"]:
            denom = exp_avg_sq.add(group["eps"]).sqrt_()
        else:
            denom = exp_avg_sq.sqrt().add_(group["eps"])
        update = exp_avg / denom
        if group["weight_decay"] != 0:
            update.add_(weight, alpha=group["weight_decay"])

        # torch.where keeps the trust ratio on device: no host sync per parameter.
        weight_norm = torch.linalg.vector_norm(weight)
        update_norm = torch.linalg.vector_norm(update)
        ratio = (weight_norm / update_norm).clamp(group["min_coeff"], group["max_coeff"])
        trust = torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))

        if group["bias_correction"]:
            step_size = group["lr"] * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        else:
            step_size = group["lr"]
        weight.add_(update.mul_(trust), alpha=-step_size)
        if weight is not param:
            param.copy_(weight)
        return trust

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios used by the last :meth:`step`, one per updated tensor (syncs once)."""
        if not self.lamb_coeffs:
            return []
        # One host copy for all ratios rather than one .item() each.
        return torch.stack(self.lamb_coeffs).tolist()
