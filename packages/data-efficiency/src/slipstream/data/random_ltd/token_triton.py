"""Triton kernels of random-LTD's token gather and scatter (one program per kept token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.triton_support import AotSpec, block_for, check_kernel_device

__all__ = ["aot_specs", "gather", "scatter"]


# seq and kept change as the schedules move: not specialised, so no recompilation per value.
@triton.jit(do_not_specialize=["seq", "kept"])
def _gather_kernel(src, idx, dst, seq, kept, width, BLOCK: tl.constexpr):
    """dst[b, k, :] = src[b, idx[b, k], :] for contiguous (batch, seq|kept, width) tensors."""
    row = tl.program_id(0)  # b * kept + k
    batch = row // kept
    token = tl.load(idx + row).to(tl.int64)
    src_row = src + (batch.to(tl.int64) * seq + token) * width
    dst_row = dst + row.to(tl.int64) * width
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        tl.store(dst_row + cols, tl.load(src_row + cols, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["seq", "kept"])
def _scatter_kernel(part, idx, dst, seq, kept, width, BLOCK: tl.constexpr):
    """dst[b, idx[b, k], :] = part[b, k, :] (in place on dst)."""
    row = tl.program_id(0)
    batch = row // kept
    token = tl.load(idx + row).to(tl.int64)
    dst_row = dst + (batch.to(tl.int64) * seq + token) * width
    part_row = part + row.to(tl.int64) * width
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        tl.store(dst_row + cols, tl.load(part_row + cols, mask=mask), mask=mask)


def gather(hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Triton gather of the kept tokens of contiguous batch-first ``hidden``."""
    check_kernel_device("random_ltd.gather", hidden, indices)
    batch, seq, width = hidden.shape
    kept = indices.shape[1]
    out = hidden.new_empty(batch, kept, width)
    if out.numel():
        _gather_kernel[(batch * kept,)](
            hidden, indices.contiguous(), out, seq, kept, width, BLOCK=block_for(width)
        )
    return out


def scatter(hidden: torch.Tensor, part: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Triton scatter of ``part`` into ``hidden`` (in place; returns ``hidden``)."""
    check_kernel_device("random_ltd.scatter", hidden, part, indices)
    batch, seq, width = hidden.shape
    kept = indices.shape[1]
    if part.numel():
        _scatter_kernel[(batch * kept,)](
            part, indices.contiguous(), hidden, seq, kept, width, BLOCK=block_for(width)
        )
    return hidden


def aot_specs() -> list[AotSpec]:
    """Specialisations to compile ahead of time (``slipstream.kernels.aot.compile_spec``)."""
    specs = []
    for dtype in ("bf16", "fp16", "fp32"):
        for name, kernel, first in (
            ("gather", _gather_kernel, "src"),
            ("scatter", _scatter_kernel, "part"),
        ):
            signature = {
                first: f"*{dtype}",
                "idx": "*i64",
                "dst": f"*{dtype}",
                "seq": "i32",
                "kept": "i32",
                "width": "i32",
                "BLOCK": "constexpr",
            }
            specs.append(AotSpec(f"random_ltd.{name}[{dtype}]", kernel, signature, {"BLOCK": 1024}))
    return specs
