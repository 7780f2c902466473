"""The ``lion`` op: a multi-tensor Lion step (DeepSpeed FusedLion semantics)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.kernels.ops.backends import register_cpp, register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "lion"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.lion.reference:lion",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.lion.triton:lion")
register_cpp(OP_NAME, "slipstream.kernels.ops.cpu_optim:lion")


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
    """Run the best available ``lion`` backend for the params' device and dtype.

    See :func:`slipstream.kernels.ops.lion.reference.lion` for the exact semantics.
    """
    if not params:
        return
    fn = get_op(OP_NAME, params[0].device.type, params[0].dtype)
    fn(
        params,
        grads,
        exp_avgs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        param_copies=param_copies,
    )
