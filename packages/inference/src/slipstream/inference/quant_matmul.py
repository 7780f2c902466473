"""Fused dequantize-matmul for decode: ``x @ W^T`` reading int8 / packed int4 codes directly.

A decode step multiplies a few rows of activations by every weight once, so its speed is the
speed of reading the weights: reading 1 (int8) or 0.5 (int4) bytes per weight instead of 2 is
the whole gain, and it is lost if the weight is first dequantized into a bf16 copy. This
Triton kernel (a GEMV: one program per block of output features and input row) dequantizes
each group in registers. Larger inputs (prefill) dequantize and call the matmul library.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path never needs Triton
    triton = None

__all__ = ["GEMV_MAX_ROWS", "dequant_gemv", "gemv_supported"]

GEMV_MAX_ROWS = 8  # more input rows than this: weights are re-read per row, use the matmul
_BLOCK_N = 16  # small blocks: enough programs to fill every SM at decode (unmeasured)

if triton is not None:

    @triton.jit
    def _dequant_gemv_kernel(
        x_ptr,
        codes_ptr,
        scales_ptr,
        out_ptr,
        n_out,
        k_in,
        GROUP: tl.constexpr,
        INT4: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """out[m, n] = sum_k x[m, k] * code[n, k] * scale[n, k // GROUP] (fp32 accumulation)."""
        block = tl.program_id(0)
        row = tl.program_id(1)
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = n < n_out
        groups = k_in // GROUP
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for g in range(0, groups):
            scale = tl.load(scales_ptr + n * groups + g, mask=keep, other=0.0)
            if INT4:
                j = tl.arange(0, GROUP // 2)
                packed = tl.load(
                    codes_ptr + n[:, None] * (k_in // 2) + g * (GROUP // 2) + j[None, :],
                    mask=keep[:, None],
                    other=0,
                ).to(tl.int32)
                low = ((packed & 15) ^ 8) - 8  # sign-extend the two's-complement nibbles
                high = (((packed >> 4) & 15) ^ 8) - 8
                x_even = tl.load(x_ptr + row * k_in + g * GROUP + 2 * j).to(tl.float32)
                x_odd = tl.load(x_ptr + row * k_in + g * GROUP + 2 * j + 1).to(tl.float32)
                part = tl.sum(low.to(tl.float32) * x_even[None, :], 1)
                part += tl.sum(high.to(tl.float32) * x_odd[None, :], 1)
            else:
                k = tl.arange(0, GROUP)
                codes = tl.load(
                    codes_ptr + n[:, None] * k_in + g * GROUP + k[None, :],
                    mask=keep[:, None],
                    other=0,
                ).to(tl.float32)
                x = tl.load(x_ptr + row * k_in + g * GROUP + k).to(tl.float32)
                part = tl.sum(codes * x[None, :], 1)
            acc += part * scale
        tl.store(out_ptr + row * n_out + n, acc, mask=keep)


def gemv_supported(x: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`dequant_gemv` can run for ``x`` (a few rows, Triton, power-of-2 groups)."""
    rows = x.numel() // max(x.shape[-1], 1)
    runs_triton = x.is_cuda or (x.device.type == "cpu" and _interpreting())
    return (
        triton is not None
        and runs_triton
        and 0 < rows <= GEMV_MAX_ROWS
        and group_size >= 16
        and group_size & (group_size - 1) == 0
    )


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def dequant_gemv(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_features: int,
    group_size: int,
    int4: bool,
) -> torch.Tensor:
    """``x @ W^T`` for the group-wise quantized ``W`` (codes and scales of ``kernels.quantize``).

    ``x`` is ``(..., in_features)``; returns ``(..., out_features)`` in ``x.dtype``.
    """
    assert triton is not None
    in_features = x.shape[-1]
    flat = x.reshape(-1, in_features).contiguous()
    out = torch.empty(flat.shape[0], out_features, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(out_features, _BLOCK_N), flat.shape[0])
    _dequant_gemv_kernel[grid](
        flat,
        codes,
        scales,
        out,
        out_features,
        in_features,
        GROUP=group_size,
        INT4=int4,
        BLOCK_N=_BLOCK_N,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)
