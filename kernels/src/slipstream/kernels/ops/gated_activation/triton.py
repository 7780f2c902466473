"""Triton SwiGLU: ``silu(gate) * up`` in one pass over the fused gate/up output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.gated_activation.reference import gated_activation as reference
from slipstream.kernels.triton_support import AotSpec, check_kernel_device

_BLOCK = 1024


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, n_half, BLOCK: tl.constexpr):
    """out[r, j] = round(silu(x[r, j])) * x[r, n + j], rounded: torch's two bf16/fp16 steps."""
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < n_half
    gate = tl.load(x_ptr + row * 2 * n_half + cols, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * n_half + n_half + cols, mask=keep, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype).to(tl.float32)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * n_half + cols, out.to(out_ptr.dtype.element_ty), mask=keep)


def gated_activation(x: torch.Tensor, name: str = "silu") -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.gated_activation.reference.gated_activation`.

    SiLU runs the kernel; the other activations (and autograd) run the reference.
    """
    check_kernel_device("gated_activation", x)
    if name != "silu" or x.shape[-1] % 2 or (torch.is_grad_enabled() and x.requires_grad):
        return reference(x, name)
    x = x.contiguous()
    half = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], half, device=x.device, dtype=x.dtype)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows:
        silu_mul_kernel[(triton.cdiv(half, _BLOCK), rows)](x, out, half, BLOCK=_BLOCK)
    return out


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    return [
        AotSpec(
            f"gated_activation.silu[{dtype}]",
            silu_mul_kernel,
            {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "n_half": "i32", "BLOCK": "constexpr"},
            {"BLOCK": _BLOCK},
        )
        for dtype in ("bf16", "fp16", "fp32")
    ]
