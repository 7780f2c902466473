"""DeepSpeed's ``deepspeed.ops.lion``: ``FusedLion`` and ``DeepSpeedCPULion``, over
:class:`slipstream.kernels.optim.Lion` (the C++ CPU Lion steps CPU parameters under offload)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from slipstream.kernels.optim import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(Lion):
    """``FusedLion(params, lr, betas, weight_decay, set_grad_none)``; ``set_grad_none`` is
    accepted (``zero_grad()`` frees gradients)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


class DeepSpeedCPULion(Lion):
    """``DeepSpeedCPULion(model_params, lr, betas, weight_decay, fp32_optimizer_states)``."""

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not fp32_optimizer_states:
            raise NotImplementedError(
                "DeepSpeedCPULion(fp32_optimizer_states=False) is not implemented; the "
                "momentum is kept in fp32"
            )
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
