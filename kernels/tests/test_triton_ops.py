"""Triton backends against their pure-torch references (CPU interpreter here, GPU with -m gpu).

Tolerances: fp32 outputs may differ from the reference by summation order only (rtol 1e-5);
half-precision outputs by one rounding of the result, plus one more under the interpreter,
which truncates fp32 -> bf16 where GPUs round to nearest (hence two units in the last place).
"""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.ops.cross_entropy.reference import cross_entropy as ce_reference
from slipstream.kernels.ops.layer_norm.reference import layer_norm as ln_reference
from slipstream.kernels.ops.rms_norm.reference import rms_norm as rms_reference
from slipstream.kernels.ops.rotary_embedding.reference import rotary_cos_sin
from slipstream.kernels.ops.rotary_embedding.reference import rotary_embedding as rope_reference
from slipstream.kernels.ops.softmax.reference import softmax as softmax_reference

TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-7, "atol": 2**-7},
    torch.float16: {"rtol": 2**-9, "atol": 2**-9},
}
HALF_GRAD = {"rtol": 2**-6, "atol": 2**-6}  # grads of half inputs: rounded inputs and output


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


def _grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    upstream = torch.randn(out.shape, generator=generator).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, upstream)


def _non_contiguous(rows: int, cols: int, device: torch.device, dtype: torch.dtype):
    # (cols, rows) transposed: a (rows, cols) view with a column stride != 1.
    return (torch.randn(cols, rows, device=device) * 2 + 0.3).t().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_forward_backward(triton_device, dtype, with_weight) -> None:
    from slipstream.kernels.ops.rms_norm.triton import rms_norm

    x = _non_contiguous(7, 45, triton_device, dtype).requires_grad_()
    assert not x.is_contiguous()
    weight = torch.randn(45, device=triton_device, dtype=dtype) if with_weight else None
    inputs: tuple[torch.Tensor, ...] = (x,)
    if weight is not None:
        weight.requires_grad_()
        inputs = (x, weight)
    out = rms_norm(x, weight, 1e-3)
    expected = rms_reference(x, weight, 1e-3)
    _close(out, expected, dtype)
    for got, want in zip(_grads(out, inputs, 1), _grads(expected, inputs, 1)):
        tolerance = TOLERANCE[dtype] if dtype == torch.float32 else HALF_GRAD
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_rms_norm_rows_wider_than_a_power_of_two(triton_device) -> None:
    from slipstream.kernels.ops.rms_norm.triton import rms_norm

    # 5000 columns: held in one masked 8192-wide block by the fused kernels (the looped
    # kernels for rows over MAX_FUSED_COLS are tested in test_op_norms.py).
    x = torch.randn(2, 5000, device=triton_device, requires_grad=True)
    weight = torch.randn(5000, device=triton_device, requires_grad=True)
    out = rms_norm(x, weight)
    expected = rms_reference(x, weight)
    _close(out, expected, torch.float32)
    for got, want in zip(_grads(out, (x, weight), 2), _grads(expected, (x, weight), 2)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_forward_backward(triton_device, dtype) -> None:
    from slipstream.kernels.ops.layer_norm.triton import layer_norm

    x = _non_contiguous(9, 33, triton_device, dtype).reshape(3, 3, 33).requires_grad_()
    weight = torch.randn(33, device=triton_device, dtype=dtype, requires_grad=True)
    bias = torch.randn(33, device=triton_device, dtype=dtype, requires_grad=True)
    out = layer_norm(x, weight, bias, 1e-5)
    expected = ln_reference(x, weight, bias, 1e-5)
    _close(out, expected, dtype)
    inputs = (x, weight, bias)
    for got, want in zip(_grads(out, inputs, 3), _grads(expected, inputs, 3)):
        tolerance = TOLERANCE[dtype] if dtype == torch.float32 else HALF_GRAD
        torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_layer_norm_without_affine_and_shape_error(triton_device) -> None:
    from slipstream.kernels.ops.layer_norm.triton import layer_norm

    x = torch.randn(4, 17, device=triton_device) * 5 + 100  # a large mean: two-pass variance
    _close(layer_norm(x), ln_reference(x), torch.float32)
    with pytest.raises(ValueError, match=r"bias shape \(16,\) must be \(17,\)"):
        layer_norm(x, None, torch.zeros(16, device=triton_device))


@pytest.mark.parametrize(
    "options",
    [
        {"scale": 0.37},
        {"causal": True},
        {"causal": True, "scale": 2.0, "mask": "bool"},
        {"mask": "additive"},
        {"mask": "all_false"},
    ],
    ids=["scale", "causal", "causal+bool_mask", "additive_mask", "fully_masked"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_forward_backward(triton_device, options, dtype) -> None:
    from slipstream.kernels.ops.softmax.triton import softmax

    options = dict(options)
    scores = torch.randn(2, 3, 5, 11, device=triton_device).to(dtype)
    scores = scores.transpose(0, 1).requires_grad_()  # (3, 2, 5, 11), not contiguous
    kind = options.pop("mask", None)
    if kind == "bool":
        options["mask"] = torch.rand(1, 2, 5, 11, device=triton_device) > 0.3
    elif kind == "additive":
        options["mask"] = torch.randn(5, 11, device=triton_device)  # broadcast over batch/heads
    elif kind == "all_false":
        options["mask"] = torch.zeros(3, 1, 1, 11, dtype=torch.bool, device=triton_device)
    out = softmax(scores, **options)
    expected = softmax_reference(scores, **options)
    _close(out, expected, dtype)
    if kind == "all_false":
        assert torch.equal(out, torch.zeros_like(out))
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else HALF_GRAD
    got, want = _grads(out, (scores,), 4)[0], _grads(expected, (scores,), 4)[0]
    torch.testing.assert_close(got.float(), want.float(), **tolerance)


def test_softmax_causal_with_fewer_keys_than_queries_and_long_rows(triton_device) -> None:
    from slipstream.kernels.ops.softmax.triton import softmax

    scores = torch.randn(6, 4, device=triton_device)  # queries > keys: first rows see nothing
    _close(softmax(scores, causal=True), softmax_reference(scores, causal=True), torch.float32)
    wide = torch.randn(2, 4100, device=triton_device)  # one row spans two blocks
    _close(softmax(wide, scale=0.5), softmax_reference(wide, scale=0.5), torch.float32)


def test_softmax_refuses_a_mask_that_needs_grad(triton_device) -> None:
    from slipstream.kernels.ops.softmax.triton import softmax

    mask = torch.zeros(4, 4, device=triton_device, requires_grad=True)
    with pytest.raises(ValueError, match="does not differentiate the mask"):
        softmax(torch.randn(4, 4, device=triton_device), mask=mask)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_forward_backward(triton_device, interleaved, dtype) -> None:
    from slipstream.kernels.ops.rotary_embedding.triton import rotary_embedding

    # (batch, heads, seq, head_dim) with a partial rotary of 10 of 14 features.
    x = torch.randn(2, 7, 3, 14, device=triton_device).to(dtype).transpose(1, 2)
    x.requires_grad_()
    cos, sin = rotary_cos_sin(7, 10, device=triton_device)
    out = rotary_embedding(x, cos, sin, interleaved=interleaved)
    expected = rope_reference(x, cos, sin, interleaved=interleaved)
    _close(out, expected, dtype)
    torch.testing.assert_close(out[..., 10:], x[..., 10:])  # pass-through features
    got, want = _grads(out, (x,), 5)[0], _grads(expected, (x,), 5)[0]
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


def test_rotary_embedding_seq_major_tables(triton_device) -> None:
    from slipstream.kernels.ops.rotary_embedding.triton import rotary_embedding

    x = torch.randn(3, 5, 2, 8, device=triton_device)  # (batch, seq, heads, head_dim)
    cos, sin = rotary_cos_sin(5, 8, device=triton_device)
    cos, sin = cos[:, None, :], sin[:, None, :]  # (seq, 1, half) broadcast over heads
    _close(rotary_embedding(x, cos, sin), rope_reference(x, cos, sin), torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_forward_backward(triton_device, reduction, dtype) -> None:
    from slipstream.kernels.ops.cross_entropy.triton import cross_entropy

    vocab = 4999  # odd, and wider than one 4096-element block
    logits = (torch.randn(3, 4, vocab, device=triton_device) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (3, 4), device=triton_device)
    target[0, 1] = target[2, 3] = -100
    out = cross_entropy(logits, target, reduction=reduction)
    expected = ce_reference(logits, target, reduction=reduction)
    _close(out, expected, dtype)
    got, want = torch.autograd.grad(out, logits)[0], torch.autograd.grad(expected, logits)[0]
    assert got.dtype == dtype
    tolerance = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else HALF_GRAD
    torch.testing.assert_close(got.float(), want.float(), **tolerance)
    assert torch.count_nonzero(got[0, 1]) == 0  # ignored tokens get no gradient


def test_cross_entropy_rejects_out_of_range_targets(triton_device) -> None:
    from slipstream.kernels.ops.cross_entropy.triton import cross_entropy

    if triton_device.type != "cpu":
        pytest.skip("the range check runs on the host only for CPU tensors")
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        cross_entropy(torch.randn(2, 10), torch.tensor([3, 10]))
