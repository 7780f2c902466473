"""Batched sampling filters equal a row-by-row reference; seeded rows ignore their batch."""

from __future__ import annotations

import torch

from slipstream.inference.serving.request import SamplingParams
from slipstream.inference.serving.sampler import filtered_probs, sample


def _reference(row: torch.Tensor, param: SamplingParams) -> torch.Tensor:
    """One row at a time: temperature, then top-k (ties kept), then top-p (at least one)."""
    scores = row.float() / param.temperature
    if param.top_k > 0:
        kth = torch.topk(scores, min(param.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if param.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= param.top_p
        scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    return torch.softmax(scores, dim=-1)


def test_batched_filters_equal_row_by_row() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=80, top_p=0.01),  # k past the vocab; one token
    ]
    probs = filtered_probs(
        logits,
        torch.tensor([p.temperature for p in params]),
        torch.tensor([p.top_k for p in params]),
        torch.tensor([p.top_p for p in params]),
    )
    for row, param in enumerate(params):
        torch.testing.assert_close(probs[row], _reference(logits[row], param))
    assert int((probs[1] > 0).sum()) == 5 and int((probs[4] > 0).sum()) == 1


def test_sample_mixes_greedy_seeded_and_unseeded_rows() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_k=1),
    ]
    generators = [None, torch.Generator().manual_seed(3), None, None]
    tokens = sample(logits, params, generators)
    assert tokens[0] == int(logits[0].argmax()) and tokens[3] == int(logits[3].argmax())
    alone = sample(logits[1:2], params[1:2], [torch.Generator().manual_seed(3)])
    assert tokens[1] == alone[0]
