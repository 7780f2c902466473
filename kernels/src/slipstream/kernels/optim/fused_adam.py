"""``FusedAdam``: a torch optimizer over the ``adam`` op (C++ on CPU, Triton/CUDA on GPUs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from slipstream.kernels.optim._validation import check_betas, check_non_negative

__all__ = ["FusedAdam"]


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with DeepSpeed ``FusedAdam`` semantics, stepping through the ``adam`` op.

    Each step calls :func:`slipstream.kernels.ops.adam` once per (device, dtype, step count)
    group of parameters, so the registry picks the backend: the multi-tensor Triton kernel (or
    the CUDA C++ one) on GPUs, the vectorised C++ CPU Adam for fp32 CPU parameters (the
    ZeRO-Offload optimizer, DeepSpeed's ``DeepSpeedCPUAdam``), the pure-torch reference
    otherwise. Moments are fp32 whatever the parameter dtype (bf16/fp16 parameters are updated
    in fp32 and rounded once).

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate.
        bias_correction: divide the moments by ``1 - beta^step``.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        adam_w_mode: decoupled weight decay (AdamW) when True, L2 (Adam) when False.
        weight_decay: the decay coefficient.

    >>> model = torch.nn.Linear(4, 4)
    >>> optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
    ) -> None:
        check_non_negative("lr", lr)
        check_non_negative("eps", eps)
        check_non_negative("weight_decay", weight_decay)
        betas = check_betas(betas)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one Adam update of every parameter that has a gradient."""
        from slipstream.kernels.ops import adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # One op call per (device, dtype, step): the kernels take lists of like tensors.
            buckets: dict[tuple[Any, ...], list[list[torch.Tensor]]] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError(
                        "FusedAdam does not support sparse gradients; use a dense embedding "
                        "(sparse=False) or torch.optim.SparseAdam for that parameter"
                    )
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                key = (param.device, param.dtype, state["step"])
                lists = buckets.setdefault(key, [[], [], [], []])
                for target, tensor in zip(
                    lists, (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
                ):
                    target.append(tensor)
            for (_, _, step), (params, grads, exp_avgs, exp_avg_sqs) in buckets.items():
                adam(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adam_w_mode=group["adam_w_mode"],
                    bias_correction=group["bias_correction"],
                    step=step,
                )
        return loss
