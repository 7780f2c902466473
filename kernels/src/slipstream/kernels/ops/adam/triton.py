"""Triton multi-tensor Adam/AdamW step (DeepSpeed FusedAdam semantics); see ops/_multi_tensor.py."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops._multi_tensor import (
    INDEX_TABLE_SIGNATURE,
    aligned_block_pointers,
    check_states_share_dtype,
    groups,
    table_signature,
)
from slipstream.kernels.triton_support import AotSpec

# Elements per program and warps: 2048 fp32 over 4 warps is 16 elements (four 16-byte accesses)
# per thread per tensor, so 16 independent loads are in flight before the first use, and the
# per-program table lookups (tensor, start, four addresses) are paid once per 2048 elements.
# (On an H100, 1024-8192 elements with 4-16 warps all ran at 94-99% of copy bandwidth once the
# accesses were 16 bytes wide; this was among the fastest.)
ADAM_BLOCK = 2048
ADAM_WARPS = 4


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
    if MASKED:
        p = tl.load(p_ptr, mask=mask, other=0.0)
        g = tl.load(g_ptr, mask=mask, other=0.0)
        m = tl.load(m_ptr, mask=mask, other=0.0)
        v = tl.load(v_ptr, mask=mask, other=0.0)
    else:
        # Streaming, read once: evict_first keeps these 16 bytes/element from crowding L2.
        p = tl.load(p_ptr, eviction_policy="evict_first")
        g = tl.load(g_ptr, eviction_policy="evict_first")
        m = tl.load(m_ptr, eviction_policy="evict_first")
        v = tl.load(v_ptr, eviction_policy="evict_first")
    p = p.to(tl.float32)
    g = g.to(tl.float32)
    m = m.to(tl.float32)
    v = v.to(tl.float32)
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
    if MASKED:
        tl.store(p_ptr, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr, v.to(v_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p_ptr, p.to(p_ptr.dtype.element_ty))
        tl.store(m_ptr, m.to(m_ptr.dtype.element_ty))
        tl.store(v_ptr, v.to(v_ptr.dtype.element_ty))


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
    """One block of one tensor per program: an Adam/AdamW step in fp32, one rounding per store.

    Full blocks (all but each tensor's last) run unmasked: a mask whose bound has unknown
    alignment would stop the compiler from using 16-byte accesses. ``ALIGNED`` (every address
    16-byte aligned, checked on the host) lets loads and stores be 16 bytes per thread.
    """
    pid = tl.program_id(0)
    tensor = tl.load(block_tensor + pid)
    start = tl.load(block_start + pid)
    if ALIGNED:
        start = tl.multiple_of(start, 16)  # blocks start at multiples of BLOCK >= 16 elements
    # The block's base pointers in int64 once per program; per-element offsets stay int32.
    offsets = tl.arange(0, BLOCK)
    remaining = tl.load(numels + tensor) - start
    p_ptr = aligned_block_pointers(param_table, param_example, tensor, ALIGNED) + start + offsets
    g_ptr = aligned_block_pointers(grad_table, grad_example, tensor, ALIGNED) + start + offsets
    m_ptr = aligned_block_pointers(exp_avg_table, state_example, tensor, ALIGNED) + start + offsets
    v_ptr = (
        aligned_block_pointers(exp_avg_sq_table, state_example, tensor, ALIGNED) + start + offsets
    )
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
        for group in groups("adam", (params, grads, exp_avgs, exp_avg_sqs), block=ADAM_BLOCK):
            check_states_share_dtype("adam", group, 2)
            adam_multi_tensor_kernel[(group.programs,)](
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
                eps,
                weight_decay,
                lr / bias_correction1,
                1.0 / math.sqrt(bias_correction2),
                ADAM_W_MODE=bool(adam_w_mode),
                ALIGNED=group.aligned,
                BLOCK=ADAM_BLOCK,
                num_warps=ADAM_WARPS,
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
        for adam_w in (True, False):
            specs.append(
                AotSpec(
                    f"adam{tag}[adam_w_mode={adam_w}]",
                    adam_multi_tensor_kernel,
                    {
                        **table_signature(
                            ("param_table", "grad_table", "exp_avg_table", "exp_avg_sq_table")
                        ),
                        **INDEX_TABLE_SIGNATURE,
                        **examples,
                        **{name: "fp32" for name in ("lr", "beta1", "beta2", "eps")},
                        "weight_decay": "fp32",
                        "step_size": "fp32",
                        "inverse_sqrt_bias_correction2": "fp32",
                        "ADAM_W_MODE": "constexpr",
                        "ALIGNED": "constexpr",
                        "BLOCK": "constexpr",
                    },
                    {"ADAM_W_MODE": adam_w, "ALIGNED": True, "BLOCK": ADAM_BLOCK},
                )
            )
    return specs
