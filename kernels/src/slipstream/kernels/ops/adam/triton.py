"""Triton multi-tensor Adam/AdamW step (DeepSpeed FusedAdam semantics); see ops/_multi_tensor.py."""

from __future__ import annotations

import math
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

# Adam's block and warps are the shared ones (see ops/_multi_tensor.py for the measurements).
ADAM_BLOCK = mt.BLOCK
ADAM_WARPS = mt.WARPS


@triton.jit
def adam_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    mask,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step_size,
    inverse_sqrt_bias_correction2,
    ADAM_W_MODE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """An Adam/AdamW step on one block in fp32, one rounding per store (``mask`` if ``MASKED``)."""
    p = load_block(p_ptr, mask, MASKED)
    g = load_block(g_ptr, mask, MASKED)
    m = load_block(m_ptr, mask, MASKED)
    v = load_block(v_ptr, mask, MASKED)
    if not ADAM_W_MODE:
        g = g + weight_decay * p  # L2 mode: the moments see the decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    # Correctly rounded sqrt/div (not the fast approximations) so GPU results track the
    # reference to fp32 rounding; the kernel is bandwidth-bound, so this costs nothing visible.
    denominator = tl.sqrt_rn(v) * inverse_sqrt_bias_correction2 + eps
    if ADAM_W_MODE:
        p = p * (1.0 - lr * weight_decay)
    p = p - step_size * tl.math.div_rn(m, denominator)
    store_block(p_ptr, p, mask, MASKED)
    store_block(m_ptr, m, mask, MASKED)
    store_block(v_ptr, v, mask, MASKED)


@triton.jit
def adam_multi_tensor_kernel(
    param_table,
    grad_table,
    exp_avg_table,
    exp_avg_sq_table,
    numels,
    block_tensor,
    block_start,
    param_example,
    grad_example,
    state_example,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    step_size,
    inverse_sqrt_bias_correction2,
    ADAM_W_MODE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block of one tensor per program: an Adam/AdamW step (full blocks unmasked)."""
    tensor, start, offsets, remaining = program_block(
        numels, block_tensor, block_start, ALIGNED, BLOCK
    )
    p_ptr = block_pointers(param_table, param_example, tensor, start, offsets, ALIGNED)
    g_ptr = block_pointers(grad_table, grad_example, tensor, start, offsets, ALIGNED)
    m_ptr = block_pointers(exp_avg_table, state_example, tensor, start, offsets, ALIGNED)
    v_ptr = block_pointers(exp_avg_sq_table, state_example, tensor, start, offsets, ALIGNED)
    if remaining >= BLOCK:
        adam_block(p_ptr, g_ptr, m_ptr, v_ptr, None, lr, beta1, beta2, eps, weight_decay,
                   step_size, inverse_sqrt_bias_correction2, ADAM_W_MODE, False)  # fmt: skip
    else:
        adam_block(p_ptr, g_ptr, m_ptr, v_ptr, offsets < remaining, lr, beta1, beta2, eps,
                   weight_decay, step_size, inverse_sqrt_bias_correction2, ADAM_W_MODE, True)  # fmt: skip


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
    """Triton multi-tensor Adam/AdamW with the semantics of :func:`slipstream.kernels.ops.adam.reference.adam`.

    ``param_copies`` (optional) receive the updated params afterwards (one ``_foreach_copy_``;
    the fused copy-back lives in the CPU backend, where offload needs it).
    """
    if not params:
        return
    if step < 1:
        raise ValueError(f"adam: step must be >= 1 (the step being taken), got {step}")
    bias_correction1 = 1.0 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1.0 - beta2**step if bias_correction else 1.0
    with torch.no_grad():
        lists = (params, grads, exp_avgs, exp_avg_sqs)
        for group in mt.groups("adam", lists, ADAM_BLOCK, states_from=2):
            group.launch(
                adam_multi_tensor_kernel,
                (0, 1, 2, 3),
                (0, 1, 2),
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
                lr / bias_correction1,
                1.0 / math.sqrt(bias_correction2),
                warps=ADAM_WARPS,
                ADAM_W_MODE=bool(adam_w_mode),
            )
        if param_copies is not None:
            torch._foreach_copy_(list(param_copies), list(params))


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    return list(
        mt.aot_specs(
            "adam",
            adam_multi_tensor_kernel,
            ("param_table", "grad_table", "exp_avg_table", "exp_avg_sq_table"),
            ("param_example", "grad_example", "state_example"),
            mt.fp32_scalars(
                "lr",
                "beta1",
                "beta2",
                "eps",
                "weight_decay",
                "step_size",
                "inverse_sqrt_bias_correction2",
            ),
            [{"ADAM_W_MODE": adam_w} for adam_w in (True, False)],
            ADAM_BLOCK,
        )
    )
