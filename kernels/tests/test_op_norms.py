"""The reference ``rms_norm`` and ``layer_norm`` ops against float64 formulas."""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.ops import layer_norm as dispatched_layer_norm
from slipstream.kernels.ops import rms_norm as dispatched_rms_norm
from slipstream.kernels.ops.layer_norm.reference import layer_norm
from slipstream.kernels.ops.rms_norm.reference import rms_norm

FP32 = {"rtol": 1e-5, "atol": 1e-6}  # fp32 result vs a float64 formula
BF16 = {"rtol": 2**-7, "atol": 2**-7}  # one bf16 rounding of values of order 1


def rms_formula(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x64 = x.double()
    out = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x64.shape[-1] + eps)
    return out if weight is None else out * weight.double()


def layer_norm_formula(x, weight, bias, eps) -> torch.Tensor:
    x64 = x.double()
    n = x64.shape[-1]
    mean = x64.sum(-1, keepdim=True) / n
    variance = ((x64 - mean) ** 2).sum(-1, keepdim=True) / n  # biased, as nn.LayerNorm
    out = (x64 - mean) / torch.sqrt(variance + eps)
    if weight is not None:
        out = out * weight.double()
    if bias is not None:
        out = out + bias.double()
    return out


def _input(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # (hidden, seq, batch) transposed to (batch, seq, hidden): a non-contiguous input.
    return (torch.randn(48, 5, 3, device=device) * 3 + 0.5).permute(2, 1, 0).to(dtype)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_formula(kernel_device: torch.device, with_weight: bool) -> None:
    x = _input(kernel_device)
    assert not x.is_contiguous()
    weight = torch.randn(48, device=kernel_device) if with_weight else None
    out = rms_norm(x, weight, eps=0.1)  # large enough that dropping eps fails
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), rms_formula(x, weight, 0.1), **FP32)


def test_rms_norm_bf16(kernel_device: torch.device) -> None:
    x = _input(kernel_device, torch.bfloat16)
    weight = torch.randn(48, device=kernel_device, dtype=torch.bfloat16)
    out = rms_norm(x, weight, eps=1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), rms_formula(x, weight, 1e-6), **BF16)


def test_rms_norm_gradients() -> None:
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: rms_norm(a, w, 1e-6), (x, weight))


def test_rms_norm_dispatch_and_shape_error() -> None:
    x, weight = torch.randn(2, 8), torch.randn(8)
    assert torch.equal(dispatched_rms_norm(x, weight), rms_norm(x, weight))
    with pytest.raises(ValueError, match=r"weight shape \(7,\).*\(8,\)"):
        rms_norm(x, torch.ones(7))


@pytest.mark.parametrize("with_affine", [True, False])
def test_layer_norm_matches_formula(kernel_device: torch.device, with_affine: bool) -> None:
    x = _input(kernel_device)
    weight = torch.randn(48, device=kernel_device) if with_affine else None
    bias = torch.randn(48, device=kernel_device) if with_affine else None
    out = layer_norm(x, weight, bias, eps=0.1)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), layer_norm_formula(x, weight, bias, 0.1), **FP32)


def test_layer_norm_bf16(kernel_device: torch.device) -> None:
    x = _input(kernel_device, torch.bfloat16)
    weight = torch.randn(48, device=kernel_device, dtype=torch.bfloat16)
    bias = torch.randn(48, device=kernel_device, dtype=torch.bfloat16)
    out = layer_norm(x, weight, bias)
    assert out.dtype == torch.bfloat16
    expected = layer_norm_formula(x, weight, bias, 1e-5)
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=2**-6)


def test_layer_norm_gradients() -> None:
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(10, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w, b: layer_norm(a, w, b, 1e-5), (x, weight, bias))


def test_layer_norm_dispatch_and_shape_error() -> None:
    x = torch.randn(2, 8)
    assert torch.equal(dispatched_layer_norm(x), layer_norm(x))
    with pytest.raises(ValueError, match=r"bias shape \(8, 1\) must be \(8,\)"):
        layer_norm(x, None, torch.zeros(8, 1))
