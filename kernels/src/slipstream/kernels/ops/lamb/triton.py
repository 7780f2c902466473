"""Triton multi-tensor LAMB step (two launches: moments and norms, then the update)."""

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


@triton.jit
def _lamb_update(m, v, p, eps, weight_decay, EPS_INSIDE_SQRT: tl.constexpr):
    if EPS_INSIDE_SQRT:
        denominator = tl.sqrt_rn(v + eps)
    else:
        denominator = tl.sqrt_rn(v) + eps
    return tl.math.div_rn(m, denominator) + weight_decay * p


@triton.jit
def lamb_moments_block(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    mask,
    beta1,
    beta2,
    eps,
    weight_decay,
    EPS_INSIDE_SQRT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Update one block's moments; return its ``sum(w^2)`` and ``sum(update^2)`` in fp32."""
    p = load_block(p_ptr, mask, MASKED)
    g = load_block(g_ptr, mask, MASKED)
    m = load_block(m_ptr, mask, MASKED)
    v = load_block(v_ptr, mask, MASKED)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    store_block(m_ptr, m, mask, MASKED)
    store_block(v_ptr, v, mask, MASKED)
    # Phase 2 recomputes the update from the stored (rounded) moments; use the same values here.
    m = m.to(m_ptr.dtype.element_ty).to(tl.float32)
    v = v.to(v_ptr.dtype.element_ty).to(tl.float32)
    update = _lamb_update(m, v, p, eps, weight_decay, EPS_INSIDE_SQRT)
    if MASKED:
        update = tl.where(mask, update, 0.0)  # p is 0 there, but 0 / sqrt(0 + 0) is not
    return tl.sum(p * p, axis=0), tl.sum(update * update, axis=0)


@triton.jit
def lamb_moments_kernel(
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
    weight_norm_sq,
    update_norm_sq,
    beta1,
    beta2,
    eps,
    weight_decay,
    EPS_INSIDE_SQRT: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """LAMB phase 1: update the moments; add each block's ``||w||^2`` and ``||update||^2``."""
    tensor, start, offsets, remaining = program_block(
        numels, block_tensor, block_start, ALIGNED, BLOCK
    )
    p_ptr = block_pointers(param_table, param_example, tensor, start, offsets, ALIGNED)
    g_ptr = block_pointers(grad_table, grad_example, tensor, start, offsets, ALIGNED)
    m_ptr = block_pointers(exp_avg_table, state_example, tensor, start, offsets, ALIGNED)
    v_ptr = block_pointers(exp_avg_sq_table, state_example, tensor, start, offsets, ALIGNED)
    if remaining >= BLOCK:
        weight_sq, update_sq = lamb_moments_block(p_ptr, g_ptr, m_ptr, v_ptr, None, beta1, beta2,
                                                  eps, weight_decay, EPS_INSIDE_SQRT, False)  # fmt: skip
    else:
        weight_sq, update_sq = lamb_moments_block(p_ptr, g_ptr, m_ptr, v_ptr, offsets < remaining,
                                                  beta1, beta2, eps, weight_decay,
                                                  EPS_INSIDE_SQRT, True)  # fmt: skip
    tl.atomic_add(weight_norm_sq + tensor, weight_sq)
    tl.atomic_add(update_norm_sq + tensor, update_sq)


@triton.jit
def lamb_apply_block(
    p_ptr,
    m_ptr,
    v_ptr,
    mask,
    trust,
    eps,
    weight_decay,
    step_size,
    EPS_INSIDE_SQRT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """``w -= step_size * trust * update`` on one block, the update recomputed from the moments."""
    p = load_block(p_ptr, mask, MASKED)
    m = load_block(m_ptr, mask, MASKED)
    v = load_block(v_ptr, mask, MASKED)
    update = _lamb_update(m, v, p, eps, weight_decay, EPS_INSIDE_SQRT)
    store_block(p_ptr, p - step_size * trust * update, mask, MASKED)


@triton.jit
def lamb_apply_kernel(
    param_table,
    exp_avg_table,
    exp_avg_sq_table,
    numels,
    block_tensor,
    block_start,
    param_example,
    state_example,
    weight_norm_sq,
    update_norm_sq,
    trust_out,
    eps,
    weight_decay,
    step_size,
    min_coeff,
    max_coeff,
    EPS_INSIDE_SQRT: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """LAMB phase 2: ``w -= step_size * trust * update`` with the tensor's trust ratio."""
    tensor, start, offsets, remaining = program_block(
        numels, block_tensor, block_start, ALIGNED, BLOCK
    )
    weight_norm = tl.sqrt_rn(tl.load(weight_norm_sq + tensor))
    update_norm = tl.sqrt_rn(tl.load(update_norm_sq + tensor))
    ratio = tl.minimum(tl.maximum(weight_norm / update_norm, min_coeff), max_coeff)
    trust = tl.where((weight_norm > 0) & (update_norm > 0), ratio, 1.0)
    if start == 0:
        tl.store(trust_out + tensor, trust)
    p_ptr = block_pointers(param_table, param_example, tensor, start, offsets, ALIGNED)
    m_ptr = block_pointers(exp_avg_table, state_example, tensor, start, offsets, ALIGNED)
    v_ptr = block_pointers(exp_avg_sq_table, state_example, tensor, start, offsets, ALIGNED)
    if remaining >= BLOCK:
        lamb_apply_block(p_ptr, m_ptr, v_ptr, None, trust, eps, weight_decay, step_size,
                         EPS_INSIDE_SQRT, False)  # fmt: skip
    else:
        lamb_apply_block(p_ptr, m_ptr, v_ptr, offsets < remaining, trust, eps, weight_decay,
                         step_size, EPS_INSIDE_SQRT, True)  # fmt: skip


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
    """Triton multi-tensor LAMB with the semantics of :func:`slipstream.kernels.ops.lamb.reference.lamb`.

    Two launches per dtype group: moments and per-tensor squared norms (atomic adds, so the
    norms' summation order varies run to run at fp32 rounding), then the trust-scaled update.
    Returns the trust ratios (fp32, on the params' device), one per tensor.
    """
    if step < 1:
        raise ValueError(f"lamb: step must be >= 1 (the step being taken), got {step}")
    if not params:
        return torch.empty(0)
    device = params[0].device
    trust = torch.ones(len(params), dtype=torch.float32, device=device)
    if bias_correction:
        step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    else:
        step_size = lr
    flag = {"EPS_INSIDE_SQRT": bool(eps_inside_sqrt)}
    with torch.no_grad():
        lists = (params, grads, exp_avgs, exp_avg_sqs)
        for group in mt.groups("lamb", lists, states_from=2):
            count = len(group.indices)
            norms = torch.zeros(2 * count, dtype=torch.float32, device=device)
            weight_norm_sq, update_norm_sq = norms[:count], norms[count:]
            # Every tensor in one group (the usual case): the kernel writes the ratios in place.
            whole = count == len(params)
            group_trust = trust if whole else torch.ones(count, dtype=torch.float32, device=device)
            group.launch(lamb_moments_kernel, (0, 1, 2, 3), (0, 1, 2), weight_norm_sq,
                         update_norm_sq, beta1, beta2, eps, weight_decay, **flag)  # fmt: skip
            group.launch(lamb_apply_kernel, (0, 2, 3), (0, 2), weight_norm_sq, update_norm_sq,
                         group_trust, eps, weight_decay, step_size, min_coeff, max_coeff,
                         **flag)  # fmt: skip
            if not whole:
                indices = torch.tensor(group.indices).to(device, non_blocking=True)
                trust.index_copy_(0, indices, group_trust)
    return trust


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    flags = [{"EPS_INSIDE_SQRT": False}]
    norms = {"weight_norm_sq": "*fp32", "update_norm_sq": "*fp32"}
    moments = mt.aot_specs(
        "lamb.moments",
        lamb_moments_kernel,
        ("param_table", "grad_table", "exp_avg_table", "exp_avg_sq_table"),
        ("param_example", "grad_example", "state_example"),
        {**norms, **mt.fp32_scalars("beta1", "beta2", "eps", "weight_decay")},
        flags,
    )
    apply = mt.aot_specs(
        "lamb.apply",
        lamb_apply_kernel,
        ("param_table", "exp_avg_table", "exp_avg_sq_table"),
        ("param_example", "state_example"),
        {**norms, "trust_out": "*fp32",
         **mt.fp32_scalars("eps", "weight_decay", "step_size", "min_coeff", "max_coeff")},
        flags,
    )  # fmt: skip
    return [*moments, *apply]
