"""The reference attention-score ``softmax`` op against torch.softmax with explicit masks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import softmax as dispatched_softmax
from slipstream.kernels.ops.softmax.reference import causal_keep_mask, softmax

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def keep_mask_by_loops(queries: int, keys: int) -> torch.Tensor:
    """Query i sees key j when j <= i + (keys - queries): bottom-right aligned causality."""
    return torch.tensor(
        [[j <= i + keys - queries for j in range(keys)] for i in range(queries)], dtype=torch.bool
    )


@pytest.mark.parametrize("scale", [None, 0.125])
def test_plain_and_scaled(kernel_device: torch.device, scale: float | None) -> None:
    # (batch, heads, keys, queries) transposed to (..., queries, keys): non-contiguous.
    scores = (torch.randn(2, 3, 9, 5, device=kernel_device) * 5).transpose(-1, -2)
    out = softmax(scores, scale=scale)
    expected = torch.softmax(scores * (1.0 if scale is None else scale), dim=-1)
    torch.testing.assert_close(out, expected, **FP32)


@pytest.mark.parametrize(("queries", "keys"), [(6, 6), (3, 8)])
def test_causal(kernel_device: torch.device, queries: int, keys: int) -> None:
    scores = torch.randn(2, 4, queries, keys, device=kernel_device, requires_grad=True)
    keep = keep_mask_by_loops(queries, keys).to(kernel_device)
    out = softmax(scores, scale=0.5, causal=True)
    reference_scores = scores.detach().clone().requires_grad_()
    expected = torch.softmax((reference_scores * 0.5).masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(out, expected, **FP32)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(scores.grad, reference_scores.grad, **FP32)


def test_causal_with_more_queries_than_keys_zeroes_rows_that_see_nothing() -> None:
    scores = torch.randn(5, 3, requires_grad=True)
    out = softmax(scores, causal=True)
    keep = keep_mask_by_loops(5, 3)
    assert torch.equal(out[:2], torch.zeros(2, 3))  # rows 0 and 1 see no key
    expected = torch.softmax(scores[2:].detach().masked_fill(~keep[2:], float("-inf")), dim=-1)
    torch.testing.assert_close(out[2:], expected, **FP32)
    out.sum().backward()
    assert torch.isfinite(scores.grad).all()


def test_causal_keep_mask_helper() -> None:
    for queries, keys in [(4, 4), (2, 6), (6, 2), (1, 5)]:
        assert torch.equal(causal_keep_mask(queries, keys), keep_mask_by_loops(queries, keys))


def test_boolean_and_additive_masks(kernel_device: torch.device) -> None:
    scores = torch.randn(2, 3, 4, 7, device=kernel_device)
    keep = torch.rand(2, 1, 4, 7, device=kernel_device) > 0.3
    keep[..., 0] = True  # every row keeps something
    out = softmax(scores, mask=keep)
    expected = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(out, expected, **FP32)

    bias = torch.randn(4, 7, device=kernel_device)
    out = softmax(scores, scale=0.3, mask=bias)
    torch.testing.assert_close(out, torch.softmax(scores * 0.3 + bias, dim=-1), **FP32)


def test_fully_masked_row_is_zero_not_nan() -> None:
    scores = torch.randn(3, 5, requires_grad=True)
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1] = False
    out = softmax(scores, mask=keep)
    assert torch.equal(out[1], torch.zeros(5))
    assert torch.isnan(
        torch.softmax(scores.detach().masked_fill(~keep, float("-inf")), -1)[1]
    ).all()
    out.sum().backward()
    assert torch.isfinite(scores.grad).all()


def test_bf16(kernel_device: torch.device) -> None:
    scores = torch.randn(2, 8, 8, device=kernel_device).bfloat16()
    out = softmax(scores, scale=0.25, causal=True)
    assert out.dtype == torch.bfloat16
    keep = keep_mask_by_loops(8, 8).to(kernel_device)
    expected = torch.softmax((scores.float() * 0.25).masked_fill(~keep, float("-inf")), dim=-1)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-3)


def test_attention_built_on_softmax_matches_sdpa() -> None:
    q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
    probabilities = softmax(q @ k.transpose(-1, -2), scale=16**-0.5, causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(probabilities @ v, expected, **FP32)


def test_dispatch_and_errors() -> None:
    scores = torch.randn(4, 4)
    assert torch.equal(dispatched_softmax(scores, causal=True), softmax(scores, causal=True))
    with pytest.raises(ValueError, match=r"causal masking needs \(..., queries, keys\)"):
        softmax(torch.randn(4), causal=True)
