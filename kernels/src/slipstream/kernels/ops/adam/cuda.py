"""The CUDA C++ fused Adam/AdamW (``csrc/``; hipified for ROCm by torch's build tools).

Registered as backend ``"cuda"`` of ``adam`` below the Triton backend: it is what runs on a
GPU machine without Triton. Built into the extension cache like every C++ op (see
:mod:`slipstream.kernels.build_ops`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.kernels.build_ops import FUSED_ADAM_CUDA, load_extension
from slipstream.kernels.ops.adam.reference import adam as adam_reference

_SUPPORTED = {
    (torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.float16, torch.float16, torch.float32),
    (torch.float16, torch.float32, torch.float32),
}


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
    """CUDA/HIP fused Adam/AdamW with the semantics of :func:`..reference.adam`.

    Tensors whose (param, grad, state) dtypes the kernel does not cover, or that are not
    contiguous, are updated by the reference in the same call.
    """
    fused: list[int] = []
    other: list[int] = []
    for index, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        contiguous = all(t.is_contiguous() for t in (p, g, m, v))
        same_state = m.dtype == v.dtype
        if contiguous and same_state and (p.dtype, g.dtype, m.dtype) in _SUPPORTED:
            fused.append(index)
        else:
            other.append(index)
    options = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adam_w_mode=adam_w_mode,
        bias_correction=bias_correction,
        step=step,
    )
    if fused:
        load_extension(FUSED_ADAM_CUDA).fused_adam(
            [params[i] for i in fused],
            [grads[i] for i in fused],
            [exp_avgs[i] for i in fused],
            [exp_avg_sqs[i] for i in fused],
            float(lr),
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
            bool(adam_w_mode),
            bool(bias_correction),
            int(step),
        )
    if other:
        adam_reference(
            [params[i] for i in other],
            [grads[i] for i in other],
            [exp_avgs[i] for i in other],
            [exp_avg_sqs[i] for i in other],
            **options,  # type: ignore[arg-type]
        )
    if param_copies is not None:
        torch._foreach_copy_(list(param_copies), list(params))
