"""``decode_gemv``, ``norm_gemv`` and ``gated_gemv``: references against the unfused steps, the
Triton kernel against the references (every prologue, ragged and even tiles, bias, a few rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import (
    add_rms_norm,
    decode_gemv,
    gated_activation,
    gated_gemv,
    norm_gemv,
    rms_norm,
)


def test_references_are_the_unfused_steps() -> None:
    x, r, nw = torch.randn(1, 40), torch.randn(1, 40), torch.randn(40)
    w, b = torch.randn(24, 40), torch.randn(24)
    torch.testing.assert_close(decode_gemv(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    total, y = norm_gemv(x, r, nw, 1e-5, w, b)
    expected_total, normed = add_rms_norm(x, r, nw, 1e-5)
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
    torch.testing.assert_close(y, F.linear(normed, w, b), rtol=0, atol=0)
    total, y = norm_gemv(x, None, nw, 1e-5, w)
    assert total is x
    torch.testing.assert_close(y, F.linear(rms_norm(x, nw, 1e-5), w), rtol=0, atol=0)
    gate_up = torch.randn(1, 80)
    torch.testing.assert_close(
        gated_gemv(gate_up, w, b), F.linear(gated_activation(gate_up), w, b), rtol=0, atol=0
    )


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


@pytest.mark.parametrize("shape", [(1, 32, 512), (2, 20, 96)])  # even tiles; ragged N and K
def test_triton_matches_reference(triton_device: torch.device, shape: tuple[int, int, int]) -> None:
    from slipstream.kernels.ops.decode_gemv import triton as kernel
    from slipstream.kernels.ops.decode_gemv.reference import gated_gemv as gated_reference
    from slipstream.kernels.ops.decode_gemv.reference import norm_gemv as norm_reference

    rows, n, k = shape
    dtypes = [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)

    def rand(*size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(triton_device, dtype)

    block_k = 64 if k > 100 else 32
    # One program per block, and a persistent grid (8 "SMs" on the CPU; 1 program each walks
    # several blocks of 4 output features).
    configs = [
        kernel.DecodeGemvConfig(block_n=8, block_k=block_k),
        kernel.DecodeGemvConfig(block_n=4, block_k=block_k, programs_per_sm=1, prefetch=True),
    ]
    with torch.no_grad():
        for dtype, config in [(d, c) for d in dtypes for c in configs]:
            # fp32 differs by summation order only; half precision by the one rounding of the
            # output after an fp32 sum of K products (relative ~2^-8 of the largest terms).
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            x, r, nw = rand(rows, k, dtype=dtype), rand(rows, k, dtype=dtype), rand(k, dtype=dtype)
            w, b = rand(n, k, dtype=dtype) / k**0.5, rand(n, dtype=dtype)
            for bias in (None, b):
                torch.testing.assert_close(
                    kernel.decode_gemv(x, w, bias, config),
                    F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(
                        dtype
                    ),
                    rtol=tol,
                    atol=tol,
                )
            for residual in (None, r):
                total, y = kernel.norm_gemv(x, residual, nw, 1e-6, w, b, config)
                expected_total, expected = norm_reference(x, residual, nw, 1e-6, w, b)
                # The residual sum is rounded as torch's add rounds it: bit-exact.
                torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
                torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
            gate_up = rand(rows, 2 * k, dtype=dtype)
            torch.testing.assert_close(
                kernel.gated_gemv(gate_up, w, b, config),
                gated_reference(gate_up, w, b),
                rtol=tol,
                atol=tol,
            )
        # The default launch (no config), and the reference past MAX_ROWS rows.
        x, w = rand(1, k, dtype=torch.float32), rand(n, k, dtype=torch.float32)
        torch.testing.assert_close(kernel.decode_gemv(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
        many = rand(kernel.MAX_ROWS + 1, k, dtype=torch.float32)
        torch.testing.assert_close(kernel.decode_gemv(many, w), F.linear(many, w))


def test_default_config_keeps_every_sm_busy() -> None:
    from slipstream.kernels.ops.decode_gemv.triton import default_config

    cpu = torch.device("cpu")  # 8 "SMs" off the GPU
    assert default_config(128256, 4096, cpu).block_n == 16  # lm_head: wide tiles
    assert default_config(64, 4096, cpu).block_n == 2  # tiny N: as many programs as it gets
