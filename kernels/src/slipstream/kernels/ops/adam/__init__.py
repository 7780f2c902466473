"""The ``adam`` op: a multi-tensor Adam/AdamW step (DeepSpeed FusedAdam semantics)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.kernels.build_ops import fused_adam_cuda_probe
from slipstream.kernels.ops.backends import register_cpp, register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "adam"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.adam.reference:adam",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.adam.triton:adam")
register_cpp(OP_NAME, "slipstream.kernels.ops.cpu_optim:adam")
# CUDA C++ (hipified on ROCm): below Triton, for GPU machines without it.
register_op(
    OP_NAME,
    "cuda",
    "slipstream.kernels.ops.adam.cuda:adam",
    device_types=("cuda",),
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    priority=5,
    available=fused_adam_cuda_probe,
)


def adam(
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
    adam_w_mode: bool,
    bias_correction: bool,
    step: int,
    param_copies: Sequence[torch.Tensor] | None = None,
) -> None:
    """Run the best available ``adam`` backend for the params' device and dtype.

    See :func:`slipstream.kernels.ops.adam.reference.adam` for the exact semantics.
    """
    if not params:
        return
    fn = get_op(OP_NAME, params[0].device.type, params[0].dtype)
    fn(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        step=step,
        param_copies=param_copies,
    )
