"""The ``adagrad`` op: a multi-tensor Adagrad step (the CPU-offload optimizer of DeepSpeed)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.kernels.ops.backends import register_cpp
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "adagrad"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.adagrad.reference:adagrad",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_cpp(OP_NAME, "slipstream.kernels.ops.cpu_optim:adagrad")


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
    """Run the best available ``adagrad`` backend for the params' device and dtype.

    See :func:`slipstream.kernels.ops.adagrad.reference.adagrad` for the exact semantics.
    """
    if not params:
        return
    fn = get_op(OP_NAME, params[0].device.type, params[0].dtype)
    fn(
        params,
        grads,
        exp_avg_sqs,
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        param_copies=param_copies,
    )
