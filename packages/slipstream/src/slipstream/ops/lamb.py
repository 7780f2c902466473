"""DeepSpeed's ``deepspeed.ops.lamb.FusedLamb``, over :class:`slipstream.kernels.optim.Lamb`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from slipstream.kernels.optim import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """``FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay,
    max_grad_norm, max_coeff, min_coeff, amsgrad)``; clip gradients with the config's
    ``gradient_clipping`` (``max_grad_norm`` > 0 is refused), ``amsgrad`` is not supported."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise NotImplementedError("FusedLamb(amsgrad=True) is not supported (nor in DeepSpeed)")
        if max_grad_norm > 0:
            raise NotImplementedError(
                f"FusedLamb(max_grad_norm={max_grad_norm}): clip with the config's "
                '"gradient_clipping" instead (the engine clips before the step)'
            )
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
