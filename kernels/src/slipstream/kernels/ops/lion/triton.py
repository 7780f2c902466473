"""Triton multi-tensor Lion step; see ops/_multi_tensor.py for the launch scheme."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops._multi_tensor import (
    BLOCK,
    INDEX_TABLE_SIGNATURE,
    block_pointers,
    groups,
    table_signature,
)
from slipstream.kernels.triton_support import AotSpec


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
    BLOCK: tl.constexpr,
):
    """One block of one tensor per program: a Lion step (sign of the interpolated momentum)."""
    pid = tl.program_id(0)
    tensor = tl.load(block_tensor + pid)
    offsets = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = offsets < tl.load(numels + tensor)
    p_ptr = block_pointers(param_table, param_example, tensor) + offsets
    g_ptr = block_pointers(grad_table, grad_example, tensor) + offsets
    m_ptr = block_pointers(exp_avg_table, state_example, tensor) + offsets
    p = tl.load(p_ptr, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr, mask=mask, other=0.0).to(tl.float32)
    direction = beta1 * m + (1.0 - beta1) * g
    sign = tl.where(direction > 0, 1.0, tl.where(direction < 0, -1.0, 0.0))
    p = p * (1.0 - lr * weight_decay) - lr * sign
    m = beta2 * m + (1.0 - beta2) * g
    tl.store(p_ptr, p.to(param_example.dtype.element_ty), mask=mask)
    tl.store(m_ptr, m.to(state_example.dtype.element_ty), mask=mask)


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
        for group in groups("lion", (params, grads, exp_avgs)):
            lion_multi_tensor_kernel[(group.programs,)](
                *group.tables,
                group.numel_table,
                group.block_tensor,
                group.block_start,
                group.lists[0][0],
                group.lists[1][0],
                group.lists[2][0],
                lr,
                beta1,
                beta2,
                weight_decay,
                BLOCK=BLOCK,
            )
        if param_copies is not None:
            torch._foreach_copy_(list(param_copies), list(params))


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
                f"lion{tag}",
                lion_multi_tensor_kernel,
                {
                    **table_signature(("param_table", "grad_table", "exp_avg_table")),
                    **INDEX_TABLE_SIGNATURE,
                    **examples,
                    **{name: "fp32" for name in ("lr", "beta1", "beta2", "weight_decay")},
                    "BLOCK": "constexpr",
                },
                {"BLOCK": BLOCK},
            )
        )
    return specs
