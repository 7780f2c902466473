"""Triton expert-indexed GEMV: a decode step's few (token, expert) rows read only their experts.

Program (column block, row, K split) reads the row's expert id from device memory and streams
that expert's ``(BLOCK_N, K)`` weight slice, so a CUDA graph can capture the step (no host sync
on the routing) and no gathered copy of the expert weights is made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.moe_gemv.reference import moe_gemv as reference
from slipstream.kernels.triton_support import AotSpec, check_kernel_device

MAX_ROWS = 64  # beyond this the grouped matmul (one expert's tokens at a time) reads less


@triton.jit
def moe_gemv_kernel(
    x_ptr,
    experts_ptr,
    w_ptr,
    out_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r, n] = sum_k w[experts[r], n, k] * x[r, k], fp32 accumulation."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    expert = tl.load(experts_ptr + row).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    base = w_ptr + expert * N * K + cols.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(base + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        xk = tl.load(x_ptr + row * K + k, mask=k_ok, other=0.0)
        acc += tl.sum(w.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def moe_gemv(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """See :func:`slipstream.kernels.ops.moe_gemv.reference.moe_gemv`."""
    check_kernel_device("moe_gemv", x, experts, weights)
    if (
        x.dim() != 2
        or weights.dim() != 3
        or x.shape[0] > MAX_ROWS
        or weights.dtype != x.dtype
        or not weights.is_contiguous()
    ):
        return reference(x, experts, weights)
    x = x.contiguous()
    rows, k = x.shape
    n = weights.shape[1]
    if weights.shape[2] != k or experts.shape != (rows,):
        return reference(x, experts, weights)  # raises the named error
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    if rows:
        grid = (triton.cdiv(n, 64), rows)
        moe_gemv_kernel[grid](x, experts, weights, out, n, k, BLOCK_N=64, BLOCK_K=128)
    return out


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    return [
        AotSpec(
            f"moe_gemv[{dtype}]",
            moe_gemv_kernel,
            {
                "x_ptr": f"*{dtype}",
                "experts_ptr": "*i64",
                "w_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}",
                "N": "i32",
                "K": "i32",
                "BLOCK_N": "constexpr",
                "BLOCK_K": "constexpr",
            },
            {"BLOCK_N": 64, "BLOCK_K": 128},
        )
        for dtype in ("bf16", "fp16", "fp32")
    ]
