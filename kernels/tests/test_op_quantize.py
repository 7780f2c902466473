"""Group-wise quantize/dequantize: the reference against independent checks, Triton against it."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.ops.quantize import QuantizedTensor, dequantize, quantize
from slipstream.kernels.ops.quantize.reference import QMAX
from slipstream.kernels.ops.quantize.reference import dequantize as dequantize_reference
from slipstream.kernels.ops.quantize.reference import quantize as quantize_reference

FORMATS = ["int8", "int4", "fp8_e4m3"]


def _input(device, dtype=torch.float32) -> torch.Tensor:
    # (29, 37) read through a transpose: non-contiguous; 1073 elements: the last group is partial.
    x = (torch.randn(37, 29, device=device) * 3).t()
    x[0, :20] = 0  # the first 20 elements in flat order: an all-zero group when group_size <= 20
    return x.to(dtype)


@pytest.mark.parametrize("format", FORMATS)
def test_reference_round_trip_error_is_within_half_a_step(format) -> None:
    x = _input("cpu")
    q = quantize(x, format, group_size=16)
    assert isinstance(q, QuantizedTensor) and q.shape == x.shape
    restored = dequantize(q)
    assert restored.shape == x.shape and restored.dtype == x.dtype
    groups = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % 16)).view(-1, 16)
    scale = (groups.abs().amax(1) / QMAX[format]).clamp_min(1e-30)
    torch.testing.assert_close(q.scales, torch.where(scale < 1e-29, 1.0, scale))
    error = (restored.reshape(-1) - x.reshape(-1)).abs()
    step = scale.repeat_interleave(16)[: x.numel()]
    if format == "fp8_e4m3":
        # 3 mantissa bits: relative error <= 2^-4, and <= half a subnormal step (2^-10 * scale).
        bound = x.reshape(-1).abs() * 2**-4 + step * 2**-10
    else:
        bound = step / 2
    assert bool((error <= bound * (1 + 1e-6)).all())
    assert torch.count_nonzero(restored.reshape(-1)[:20]) == 0  # the zero group stays zero


def test_reference_int4_packing_layout() -> None:
    x = torch.tensor([1.0, -2.0, 7.0, -7.0, 0.0, 3.5])
    data, scales = quantize_reference(x, "int4", group_size=6)
    assert scales.tolist() == [1.0]
    # codes 1, -2, 7, -7, 0, 4 (3.5 rounds half to even): low nibble first, two's complement.
    assert data.tolist() == [[0x1 | (0xE << 4), 0x7 | (0x9 << 4), 0x0 | (0x4 << 4)]]
    restored = dequantize_reference(data, scales, "int4", 6, 6, torch.float32)
    assert restored.tolist() == [1.0, -2.0, 7.0, -7.0, 0.0, 4.0]


def test_reference_fp8_matches_torch_cast() -> None:
    x = torch.randn(4, 64) * 10
    data, scales = quantize_reference(x, "fp8_e4m3", group_size=64)
    expected = (x / scales[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), expected.view(torch.uint8))


def test_format_errors() -> None:
    with pytest.raises(ValueError, match="format must be one of"):
        quantize(torch.randn(8), "int2")
    with pytest.raises(ValueError, match="group_size must be even"):
        quantize(torch.randn(8), "int4", group_size=7)
    with pytest.raises(ValueError, match="positive int"):
        quantize(torch.randn(8), "int8", group_size=0)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 50])
def test_triton_codes_match_reference_bit_for_bit(triton_device, format, dtype, group_size) -> None:
    from slipstream.kernels.ops.quantize.triton import dequantize as dequantize_triton
    from slipstream.kernels.ops.quantize.triton import quantize as quantize_triton

    x = _input(triton_device, dtype)
    data, scales = quantize_triton(x, format, group_size)
    expected_data, expected_scales = quantize_reference(x, format, group_size)
    assert data.dtype == expected_data.dtype and data.shape == expected_data.shape
    assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
    assert torch.equal(scales, expected_scales)
    restored = dequantize_triton(data, scales, format, group_size, x.numel(), dtype)
    expected = dequantize_reference(data, scales, format, group_size, x.numel(), dtype)
    # fp32 results are exact (code * scale is one rounding); half results may differ by the
    # interpreter's truncation of the final fp32 -> half rounding (one unit in the last place).
    tolerance = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0}
    torch.testing.assert_close(restored, expected, **tolerance)


@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_16bit_scales_round_up_and_codes_follow_them(format, scale_dtype) -> None:
    """``scale_dtype``: each fp32 scale rounded up to the next 16-bit value (never below: no
    code clips; a scale under fp16's smallest subnormal becomes that subnormal, never 0), the
    codes are the fp32 encoding with the stored scale, nbytes counts 2-byte scales, and a scale
    beyond fp16's range is an error."""
    x = _input("cpu")
    x[1, :16] *= 1e-9  # a group whose fp16 scale would underflow
    wide = quantize(x, format, group_size=16)
    q = quantize(x, format, group_size=16, scale_dtype=scale_dtype)
    assert q.scales.dtype == scale_dtype and q.scales.shape == wide.scales.shape
    stored = q.scales.float()
    assert bool((stored >= wide.scales).all()) and bool((stored > 0).all())
    # at most one step of the 16-bit dtype above (fp16: 2^-10 relative, or 2^-24 subnormal)
    rel = 2.0**-10 if scale_dtype == torch.float16 else 2.0**-7
    assert bool((stored <= wide.scales * (1 + rel) + 2.0**-24).all())
    # the codes: quantize's encoding of the same values with the stored scale, bit for bit
    groups = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % 16)).view(-1, 16)
    from slipstream.kernels.ops.quantize.reference import encode

    expected = encode(groups.float(), stored, format)
    assert torch.equal(q.data.view(torch.uint8), expected.view(torch.uint8))
    restored = dequantize(q).reshape(-1)
    if format != "fp8_e4m3":
        step = stored.repeat_interleave(16)[: x.numel()]
        assert bool(((restored - x.reshape(-1)).abs() <= step / 2 + 1e-7).all())
    assert q.nbytes == q.data.numel() * q.data.element_size() + 2 * q.scales.numel()
    big = torch.full((16,), 1e9)
    if scale_dtype == torch.float16:
        with pytest.raises(ValueError, match=r"exceeds torch\.float16.s largest value"):
            quantize(big, format, 16, scale_dtype=scale_dtype)
    else:
        assert torch.isfinite(quantize(big, format, 16, scale_dtype=scale_dtype).scales).all()
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize(x, format, 16, scale_dtype=torch.float64)
