"""``quant_matmul``: the reference against dequantize-then-matmul, the Triton kernel against the
reference for int8 / int4 / fp8 codes, one and several row tiles, split-K, bias, fp32 and fp16.

bf16 runs only on the GPU (``-m gpu``): Triton's CPU interpreter computes bf16 ``tl.dot`` wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import quant_matmul, quantize
from slipstream.kernels.ops.quant_matmul.reference import check_weight, dequantize_weight
from slipstream.kernels.ops.quant_matmul.reference import quant_matmul as reference

FORMATS = ("int8", "int4", "fp8_e4m3")


def _weight(fmt: str, out_features: int = 40, in_features: int = 128, group: int = 64):
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1))
    q = quantize(w, fmt, group)
    return w, q.data.reshape(out_features, -1), q.scales


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_is_dequantize_then_linear(fmt: str) -> None:
    w, codes, scales = _weight(fmt)
    x, bias = torch.randn(3, 128), torch.randn(40)
    weight = dequantize_weight(codes, scales, fmt, 64, 128, torch.float32)
    torch.testing.assert_close(
        reference(x, codes, scales, fmt, 64, bias), F.linear(x, weight, bias)
    )
    torch.testing.assert_close(
        quant_matmul(x, codes, scales, fmt, 64, bias), F.linear(x, weight, bias)
    )
    # The quantization error itself: int8 / int4 round to half a step of absmax / qmax; e4m3
    # keeps 3 mantissa bits (relative 2^-4), or an absolute 2^-10 scale in its subnormal range.
    scale = scales.reshape(40, 2).repeat_interleave(64, dim=1)
    error = (weight - w).abs()
    if fmt == "fp8_e4m3":
        assert bool((error <= torch.maximum(w.abs() * 2**-4, scale * 2**-10) + 1e-7).all())
    else:
        assert bool((error <= scale / 2 + 1e-6).all())


def test_check_weight_names_the_problem() -> None:
    _, codes, scales = _weight("int8")
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        check_weight(codes, scales, "int8", 48, 128)
    with pytest.raises(ValueError, match="scales"):
        check_weight(codes, scales[:-1], "int8", 64, 128)
    with pytest.raises(ValueError, match="format"):
        check_weight(codes, scales, "int2", 64, 128)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_matches_reference(triton_device: torch.device, fmt: str) -> None:
    from slipstream.kernels.ops.quant_matmul.triton import QuantMatmulConfig, launch

    _, codes, scales = _weight(fmt)
    codes, scales = codes.to(triton_device), scales.to(triton_device)
    cases = [
        (1, torch.float32, QuantMatmulConfig(block_n=16, block_k=64), True),  # decode
        (3, torch.float32, QuantMatmulConfig(block_n=32, block_k=32, split_k=2), False),
        (20, torch.float32, QuantMatmulConfig(block_m=16, block_n=16, block_k=64), True),
        (2, torch.float16, QuantMatmulConfig(block_n=16, block_k=64), True),
    ]
    if triton_device.type == "cuda":
        cases.append((5, torch.bfloat16, QuantMatmulConfig(block_n=16, block_k=64), True))
    for rows, dtype, config, with_bias in cases:
        x = torch.randn(rows, 128, device=triton_device).to(dtype)
        bias = torch.randn(40, device=triton_device).to(dtype) if with_bias else None
        out = launch(x, codes, scales, fmt, 64, bias, config)
        weight = dequantize_weight(codes, scales, fmt, 64, 128, torch.float32)
        expected = F.linear(x.float(), weight, None if bias is None else bias.float())
        assert out.dtype == dtype and out.shape == (rows, 40)
        # fp32: exact products, fp32 sums in another order. fp16/bf16: the products are of the
        # rounded activations (exact), summed in fp32, rounded once to the output dtype.
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * 4)


def test_triton_dispatch_shapes(triton_device: torch.device) -> None:
    from slipstream.kernels.ops.quant_matmul import triton as backend

    _, codes, scales = _weight("int4")
    codes, scales = codes.to(triton_device), scales.to(triton_device)
    x = torch.randn(2, 1, 128, device=triton_device)
    out = backend.quant_matmul(x, codes, scales, "int4", 64)
    assert out.shape == (2, 1, 40)
    torch.testing.assert_close(out, reference(x, codes, scales, "int4", 64), rtol=1e-5, atol=1e-5)
    assert backend.default_config(1, 40, 128, "int4", 16, triton_device) is None  # < tl.dot's K
    few = backend.default_config(1, 64, 4096, "int8", 128, torch.device("cpu"))
    assert few is not None and few.split_k == 4  # 2 column blocks cannot fill 8 "SMs": split K
    many = backend.default_config(1, 28672, 4096, "int8", 128, torch.device("cpu"))
    assert many is not None and many.split_k == 1
    short = backend.default_config(1, 64, 128, "int8", 64, torch.device("cpu"))
    assert short is not None and short.split_k == 2  # never more splits than K steps
    # Prefill rows: the weight dequantized by the row kernel (bit-equal to the reference's
    # dequantization), then the matmul.
    for fmt in ("int8", "int4", "fp8_e4m3"):
        _, codes, scales = _weight(fmt)
        codes, scales = codes.to(triton_device), scales.to(triton_device)
        for dtype in (torch.float32, torch.float16):
            weight = backend.dequantize_rows(codes, scales, fmt, 64, 128, dtype)
            expected = dequantize_weight(codes, scales, fmt, 64, 128, dtype)
            torch.testing.assert_close(weight, expected, rtol=0, atol=0)
        x = torch.randn(backend.DEQUANTIZE_ABOVE_ROWS + 1, 128, device=triton_device)
        torch.testing.assert_close(
            backend.quant_matmul(x, codes, scales, fmt, 64),
            reference(x, codes, scales, fmt, 64),
            rtol=1e-5,
            atol=1e-5,
        )
    assert backend.default_config(64, 4096, 4096, "int8", 128, torch.device("cpu")).block_m == 64  # type: ignore[union-attr]


def test_dense_gemv_matches_linear(triton_device: torch.device) -> None:
    from slipstream.kernels.ops.quant_matmul.triton import dense_gemv

    generator = torch.Generator().manual_seed(2)
    dtypes = [torch.float16] + ([torch.bfloat16] if triton_device.type == "cuda" else [])
    for dtype in dtypes:
        weight = torch.randn(40, 128, generator=generator).to(triton_device, dtype)
        bias = torch.randn(40, generator=generator).to(triton_device, dtype)
        for rows in (1, 5):
            x = torch.randn(rows, 128, generator=generator).to(triton_device, dtype)
            expected = F.linear(x.float(), weight.float(), bias.float())
            out = dense_gemv(x, weight, bias)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=3e-2)
    x32 = torch.randn(2, 128, device=triton_device)  # fp32: the matmul library (exact)
    w32 = torch.randn(40, 128, device=triton_device)
    torch.testing.assert_close(dense_gemv(x32, w32), F.linear(x32, w32), rtol=0, atol=0)
