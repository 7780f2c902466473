"""Triton multi-tensor Lion step; see ops/_multi_tensor.py for the launch scheme."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops import _multi_tensor as mt
from slipstream.kernels.ops._multi_tensor import (
    block_pointers,
    load_block,
    program_block,
    store_block,
)
from slipstream.kernels.triton_support import AotSpec


@triton.jit
def lion_block(p_ptr, g_ptr, m_ptr, mask, lr, beta1, beta2, weight_decay, MASKED: tl.constexpr):
    """A Lion step on one block in fp32 (sign of the interpolated momentum), one rounding per store."""
    p = load_block(p_ptr, mask, MASKED)
    g = load_block(g_ptr, mask, MASKED)
    m = load_block(m_ptr, mask, MASKED)
    direction = beta1 * m + (1.0 - beta1) * g
    sign = tl.where(direction > 0, 1.0, tl.where(direction < 0, -1.0, 0.0))
    p = p * (1.0 - lr * weight_decay) - lr * sign
    m = beta2 * m + (1.0 - beta2) * g
    store_block(p_ptr, p, mask, MASKED)
    store_block(m_ptr, m, mask, MASKED)


@triton.jit
def lion_multi_tensor_kernel(
    param_table,
    grad_table,
    exp_avg_table,
    numels,
    block_tensor,
    block_start,
    param_example,
    grad_example,
    state_example,
    lr,
    beta1,
    beta2,
    weight_decay,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block of one tensor per program: a Lion step (full blocks unmasked)."""
    tensor, start, offsets, remaining = program_block(
        numels, block_tensor, block_start, ALIGNED, BLOCK
    )
    p_ptr = block_pointers(param_table, param_example, tensor, start, offsets, ALIGNED)
    g_ptr = block_pointers(grad_table, grad_example, tensor, start, offsets, ALIGNED)
    m_ptr = block_pointers(exp_avg_table, state_example, tensor, start, offsets, ALIGNED)
    if remaining >= BLOCK:
        lion_block(p_ptr, g_ptr, m_ptr, None, lr, beta1, beta2, weight_decay, False)
    else:
        lion_block(p_ptr, g_ptr, m_ptr, offsets < remaining, lr, beta1, beta2, weight_decay, True)


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
    """Triton multi-tensor Lion with the semantics of :func:`slipstream.kernels.ops.lion.reference.lion`."""
    if not params:
        return
    with torch.no_grad():
        for group in mt.groups("lion", (params, grads, exp_avgs)):
            group.launch(
                lion_multi_tensor_kernel, (0, 1, 2), (0, 1, 2), lr, beta1, beta2, weight_decay
            )
        if param_copies is not None:
            torch._foreach_copy_(list(param_copies), list(params))


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    return list(
        mt.aot_specs(
            "lion",
            lion_multi_tensor_kernel,
            ("param_table", "grad_table", "exp_avg_table"),
            ("param_example", "grad_example", "state_example"),
            mt.fp32_scalars("lr", "beta1", "beta2", "weight_decay"),
        )
    )
