"""The ``lamb`` op: a multi-tensor LAMB step (DeepSpeed FusedLamb semantics)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "lamb"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.lamb.reference:lamb",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.lamb.triton:lamb")


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
    """Run the best available ``lamb`` backend; returns the trust ratios (fp32, one per tensor).

    See :func:`slipstream.kernels.ops.lamb.reference.lamb` for the exact semantics.
    """
    if not params:
        return torch.empty(0)
    fn = get_op(OP_NAME, params[0].device.type, params[0].dtype)
    return fn(  # type: ignore[no-any-return]
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
        step=step,
        eps_inside_sqrt=eps_inside_sqrt,
        max_coeff=max_coeff,
        min_coeff=min_coeff,
    )
