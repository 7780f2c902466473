"""Triton multi-tensor LAMB step (two launches: moments and norms, then the update)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops._multi_tensor import (
    BLOCK,
    INDEX_TABLE_SIGNATURE,
    block_pointers,
    check_states_share_dtype,
    groups,
    table_signature,
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
    BLOCK: tl.constexpr,
):
    """LAMB phase 1: update the moments; add each block's ``||w||^2`` and ``||update||^2``."""
    pid = tl.program_id(0)
    tensor = tl.load(block_tensor + pid)
    offsets = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = offsets < tl.load(numels + tensor)
    p_ptr = block_pointers(param_table, param_example, tensor) + offsets
    g_ptr = block_pointers(grad_table, grad_example, tensor) + offsets
    m_ptr = block_pointers(exp_avg_table, state_example, tensor) + offsets
    v_ptr = block_pointers(exp_avg_sq_table, state_example, tensor) + offsets
    p = tl.load(p_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr, mask=mask, other=0.0).to(tl.float32)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    m = m.to(state_example.dtype.element_ty)
    v = v.to(state_example.dtype.element_ty)
    tl.store(m_ptr, m, mask=mask)
    tl.store(v_ptr, v, mask=mask)
    # Phase 2 recomputes the update from the stored (rounded) moments; use the same values here.
    update = _lamb_update(m.to(tl.float32), v.to(tl.float32), p, eps, weight_decay, EPS_INSIDE_SQRT)
    update = tl.where(mask, update, 0.0)
    tl.atomic_add(weight_norm_sq + tensor, tl.sum(p * p, axis=0))
    tl.atomic_add(update_norm_sq + tensor, tl.sum(update * update, axis=0))


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
    BLOCK: tl.constexpr,
):
    """LAMB phase 2: ``w -= step_size * trust * update`` with the tensor's trust ratio."""
    pid = tl.program_id(0)
    tensor = tl.load(block_tensor + pid)
    start = tl.load(block_start + pid)
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < tl.load(numels + tensor)
    weight_norm = tl.sqrt_rn(tl.load(weight_norm_sq + tensor))
    update_norm = tl.sqrt_rn(tl.load(update_norm_sq + tensor))
    ratio = tl.minimum(tl.maximum(weight_norm / update_norm, min_coeff), max_coeff)
    trust = tl.where((weight_norm > 0) & (update_norm > 0), ratio, 1.0)
    if start == 0:
        tl.store(trust_out + tensor, trust)
    p_ptr = block_pointers(param_table, param_example, tensor) + offsets
    m_ptr = block_pointers(exp_avg_table, state_example, tensor) + offsets
    v_ptr = block_pointers(exp_avg_sq_table, state_example, tensor) + offsets
    p = tl.load(p_ptr, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr, mask=mask, other=0.0).to(tl.float32)
    update = _lamb_update(m, v, p, eps, weight_decay, EPS_INSIDE_SQRT)
    p = p - step_size * trust * update
    tl.store(p_ptr, p.to(param_example.dtype.element_ty), mask=mask)


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
    with torch.no_grad():
        for group in groups("lamb", (params, grads, exp_avgs, exp_avg_sqs)):
            check_states_share_dtype("lamb", group, 2)
            count = len(group.indices)
            weight_norm_sq = torch.zeros(count, dtype=torch.float32, device=device)
            update_norm_sq = torch.zeros(count, dtype=torch.float32, device=device)
            group_trust = torch.ones(count, dtype=torch.float32, device=device)
            common = (group.numel_table, group.block_tensor, group.block_start)
            lamb_moments_kernel[(group.programs,)](
                *group.tables,
                *common,
                group.lists[0][0],
                group.lists[1][0],
                group.lists[2][0],
                weight_norm_sq,
                update_norm_sq,
                beta1,
                beta2,
                eps,
                weight_decay,
                EPS_INSIDE_SQRT=bool(eps_inside_sqrt),
                BLOCK=BLOCK,
            )
            lamb_apply_kernel[(group.programs,)](
                group.tables[0],
                group.tables[2],
                group.tables[3],
                *common,
                group.lists[0][0],
                group.lists[2][0],
                weight_norm_sq,
                update_norm_sq,
                group_trust,
                eps,
                weight_decay,
                step_size,
                min_coeff,
                max_coeff,
                EPS_INSIDE_SQRT=bool(eps_inside_sqrt),
                BLOCK=BLOCK,
            )
            trust[torch.tensor(group.indices, device=device)] = group_trust
    return trust


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for param, grad, state in (
        ("fp32", "fp32", "fp32"),
        ("bf16", "bf16", "fp32"),
        ("fp16", "fp32", "fp32"),
    ):
        examples = {
            "param_example": f"*{param}",
            "grad_example": f"*{grad}",
            "state_example": f"*{state}",
        }
        tag = f"[{param},{grad},{state}]"
        specs.append(
            AotSpec(
                f"lamb.moments{tag}",
                lamb_moments_kernel,
                {
                    **table_signature(
                        ("param_table", "grad_table", "exp_avg_table", "exp_avg_sq_table")
                    ),
                    **INDEX_TABLE_SIGNATURE,
                    **examples,
                    "weight_norm_sq": "*fp32",
                    "update_norm_sq": "*fp32",
                    **{name: "fp32" for name in ("beta1", "beta2", "eps", "weight_decay")},
                    "EPS_INSIDE_SQRT": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"EPS_INSIDE_SQRT": False, "BLOCK": BLOCK},
            )
        )
        specs.append(
            AotSpec(
                f"lamb.apply{tag}",
                lamb_apply_kernel,
                {
                    **table_signature(("param_table", "exp_avg_table", "exp_avg_sq_table")),
                    **INDEX_TABLE_SIGNATURE,
                    "param_example": f"*{param}",
                    "state_example": f"*{state}",
                    "weight_norm_sq": "*fp32",
                    "update_norm_sq": "*fp32",
                    "trust_out": "*fp32",
                    **{
                        name: "fp32"
                        for name in ("eps", "weight_decay", "step_size", "min_coeff", "max_coeff")
                    },
                    "EPS_INSIDE_SQRT": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"EPS_INSIDE_SQRT": False, "BLOCK": BLOCK},
            )
        )
    return specs
