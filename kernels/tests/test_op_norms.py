"""The reference ``rms_norm`` and ``layer_norm`` against float64 formulas; their Triton backends."""

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


# The Triton backends (CPU interpreter here, GPU with -m gpu) against float64 references.
# Tolerances as in test_triton_ops.py: fp32 by summation order, half by one rounding of the result
# (two units under the interpreter, which truncates), half gradients by rounded inputs too.
TRITON_TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7},
    torch.float16: {"rtol": 2**-9, "atol": 2**-9},
}
HALF_GRAD = {"rtol": 2**-6, "atol": 2**-6}
# (rows, cols): one column; odd widths; 130 rows so the interpreter's few persistent programs
# each own several row tiles and the last tile is ragged; a 4096-wide row in one tile.
TRITON_SHAPES = [(1, 1), (3, 37), (130, 37), (130, 1000), (3, 4096)]


def _norm_inputs(rows, cols, device, dtype, *, strided=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if strided:  # a (rows, cols) view with column stride != 1: as_rows copies it
        x = (torch.randn(cols, rows, generator=generator) * 2 + 0.7).t()
    else:
        x = torch.randn(rows, cols, generator=generator) * 2 + 0.7
    weight = torch.randn(cols, generator=generator)
    bias = torch.randn(cols, generator=generator)
    dy = torch.randn(rows, cols, generator=generator)
    return [t.to(device, dtype) for t in (x, weight, bias, dy)]


def _check_against_reference(op, reference, tensors, needs_grad, eps, dy) -> None:
    """Output and requested gradients of ``op(*tensors, eps)`` vs float64 ``reference``."""
    dtype = tensors[0].dtype
    ours = [
        None if t is None else t.detach().clone().requires_grad_(g)
        for t, g in zip(tensors, needs_grad)
    ]
    exact = [
        None if t is None else t.detach().double().requires_grad_(g)
        for t, g in zip(tensors, needs_grad)
    ]
    out, expected = op(*ours, eps), reference(*exact, eps)
    assert out.dtype == dtype and out.shape == tensors[0].shape
    torch.testing.assert_close(out.double(), expected, **TRITON_TOLERANCE[dtype])
    wanted = [i for i, t in enumerate(ours) if t is not None and t.requires_grad]
    got = torch.autograd.grad(out, [ours[i] for i in wanted], dy)
    want = torch.autograd.grad(expected, [exact[i] for i in wanted], dy.double())
    grad_tolerance = TRITON_TOLERANCE[dtype] if dtype == torch.float32 else HALF_GRAD
    for index, g, w in zip(wanted, got, want):
        assert g.dtype == dtype and g.shape == tensors[index].shape
        torch.testing.assert_close(g.double(), w, **grad_tolerance)


@pytest.mark.parametrize("shape", TRITON_SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_triton_rms_norm_shapes(triton_device, shape, with_weight) -> None:
    from slipstream.kernels.ops.rms_norm.triton import rms_norm as triton_rms_norm

    x, weight, _, dy = _norm_inputs(*shape, triton_device, torch.float32)
    w = weight if with_weight else None
    _check_against_reference(triton_rms_norm, rms_norm, (x, w), (True, True), 1e-3, dy)


@pytest.mark.parametrize("shape", TRITON_SHAPES)
@pytest.mark.parametrize("with_affine", [True, False])
def test_triton_layer_norm_shapes(triton_device, shape, with_affine) -> None:
    from slipstream.kernels.ops.layer_norm.triton import layer_norm as triton_layer_norm

    x, weight, bias, dy = _norm_inputs(*shape, triton_device, torch.float32)
    x = x * 3 + 20  # a large mean: the variance must be taken about the mean
    tensors = (x, weight, bias) if with_affine else (x, None, None)
    _check_against_reference(triton_layer_norm, layer_norm, tensors, (True,) * 3, 1e-5, dy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(130, 37), (3, 1000)])
def test_triton_norms_half_precision_strided(triton_device, dtype, shape) -> None:
    from slipstream.kernels.ops.layer_norm.triton import layer_norm as triton_layer_norm
    from slipstream.kernels.ops.rms_norm.triton import rms_norm as triton_rms_norm

    x, weight, bias, dy = _norm_inputs(*shape, triton_device, dtype, strided=True)
    assert not x.is_contiguous()
    _check_against_reference(triton_rms_norm, rms_norm, (x, weight), (True, True), 1e-6, dy)
    _check_against_reference(
        triton_layer_norm, layer_norm, (x, weight, bias), (True, True, True), 1e-5, dy
    )


def test_triton_norms_row_stride_view_and_frozen_params(triton_device) -> None:
    from slipstream.kernels.ops.layer_norm.triton import layer_norm as triton_layer_norm
    from slipstream.kernels.ops.rms_norm.triton import rms_norm as triton_rms_norm

    wide, weight, bias, dy = _norm_inputs(6, 50, triton_device, torch.float32)
    x = wide[:, :37].reshape(2, 3, 37)  # unit column stride, row stride 50: used as a view
    weight, bias, dy = weight[:37], bias[:37], dy[:, :37].reshape(2, 3, 37)
    # A weight that needs no gradient (no partial sums) and a bias without one.
    _check_against_reference(triton_rms_norm, rms_norm, (x, weight), (True, False), 1e-6, dy)
    _check_against_reference(
        triton_layer_norm, layer_norm, (x, weight, bias), (True, True, False), 1e-5, dy
    )
    _check_against_reference(
        triton_layer_norm, layer_norm, (x, None, bias), (True, False, True), 1e-5, dy
    )


@pytest.mark.parametrize("rows, cols", [(2, 4100), (3, 37)])
def test_triton_norms_wide_row_fallback(triton_device, monkeypatch, rows, cols) -> None:
    from slipstream.kernels.ops.layer_norm import triton as layer_norm_module
    from slipstream.kernels.ops.rms_norm import triton as rms_norm_module

    # Lower the cap so these rows take the looped kernels; 4100 > the 4096-wide loop block.
    monkeypatch.setattr(rms_norm_module, "MAX_FUSED_COLS", 16)
    monkeypatch.setattr(layer_norm_module, "MAX_FUSED_COLS", 16)
    x, weight, bias, dy = _norm_inputs(rows, cols, triton_device, torch.float32)
    _check_against_reference(
        rms_norm_module.rms_norm, rms_norm, (x, weight), (True, True), 1e-6, dy
    )
    _check_against_reference(
        layer_norm_module.layer_norm,
        layer_norm,
        (x, weight, bias),
        (True, True, True),
        1e-5,
        dy,
    )


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_triton_norms_empty_inputs(triton_device, shape) -> None:
    from slipstream.kernels.ops.layer_norm.triton import layer_norm as triton_layer_norm
    from slipstream.kernels.ops.rms_norm.triton import rms_norm as triton_rms_norm

    x = torch.randn(shape, device=triton_device, requires_grad=True)
    weight = torch.randn(shape[-1], device=triton_device, requires_grad=True)
    bias = torch.randn(shape[-1], device=triton_device, requires_grad=True)
    for out, params in (
        (triton_rms_norm(x, weight), (x, weight)),
        (triton_layer_norm(x, weight, bias), (x, weight, bias)),
    ):
        assert out.shape == x.shape
        for grad, param in zip(torch.autograd.grad(out.sum(), params), params):
            assert grad.shape == param.shape and not grad.any()


def test_triton_norm_backward_is_deterministic(triton_device) -> None:
    from slipstream.kernels.ops.layer_norm.triton import layer_norm as triton_layer_norm

    x, weight, bias, dy = _norm_inputs(130, 37, triton_device, torch.float32)
    params = [t.requires_grad_() for t in (x, weight, bias)]
    first = torch.autograd.grad(triton_layer_norm(*params), params, dy)
    second = torch.autograd.grad(triton_layer_norm(*params), params, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_triton_norm_launch_shapes() -> None:
    pytest.importorskip("triton", reason="the Triton backends need `pip install triton`")
    from slipstream.kernels.ops.rms_norm.triton import (
        FALLBACK_PROGRAMS,
        TILE_ELEMENTS,
        persistent_programs,
        row_tile,
    )

    assert row_tile(16384, 4096) == (1, 4096, 8)
    assert row_tile(16384, 5000) == (1, 8192, 8)
    assert row_tile(16384, 16384) == (1, 16384, 16)
    assert row_tile(16384, 1000) == (2, 1024, 4)
    rows, block, _ = row_tile(130, 37)
    assert block == 64 and rows * block == TILE_ELEMENTS
    assert row_tile(3, 37)[0] == 4  # never more rows per tile than the input has (rounded up)
    assert persistent_programs(torch.device("cpu"), 1000) == FALLBACK_PROGRAMS
    assert persistent_programs(torch.device("cpu"), 1) == 1
