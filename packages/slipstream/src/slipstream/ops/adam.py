"""DeepSpeed's ``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` with their arguments.

Both step through Slipstream's ``adam`` op, which picks the C++ CPU Adam for CPU parameters
and the Triton/CUDA kernel on GPUs; the two classes differ only in DeepSpeed's argument names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from slipstream.kernels.optim import FusedAdam as _KernelsFusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _refuse_amsgrad(amsgrad: bool, cls: str) -> None:
    if amsgrad:
        raise NotImplementedError(
            f"{cls}(amsgrad=True) is not implemented (DeepSpeed's fused kernels refuse it too); "
            "use torch.optim.Adam(amsgrad=True)"
        )


class FusedAdam(_KernelsFusedAdam):
    """``deepspeed.ops.adam.FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode,
    weight_decay, amsgrad, set_grad_none)``; ``set_grad_none`` is accepted (gradients are freed
    by ``zero_grad()`` as torch does by default)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _refuse_amsgrad(amsgrad, "FusedAdam")
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adam_w_mode,
            weight_decay=weight_decay,
        )


class DeepSpeedCPUAdam(_KernelsFusedAdam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps,
    weight_decay, amsgrad, adamw_mode, fp32_optimizer_states)``: Adam over CPU parameters
    through the C++ CPU Adam. Moments are always fp32 (``fp32_optimizer_states=False`` is
    refused)."""

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _refuse_amsgrad(amsgrad, "DeepSpeedCPUAdam")
        if not fp32_optimizer_states:
            raise NotImplementedError(
                "DeepSpeedCPUAdam(fp32_optimizer_states=False): moments in the parameters' "
                "dtype are not implemented; Slipstream keeps them in fp32"
            )
        super().__init__(
            model_params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            adam_w_mode=adamw_mode,
            weight_decay=weight_decay,
        )
