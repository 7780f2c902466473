"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from slipstream.inference.serving.request import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` (``(rows, vocab)``), following each row's parameters.

    Greedy rows share one argmax; sampled rows draw from their own generator when the request
    has a seed, so their tokens do not depend on what they were batched with.
    """
    # One device-to-host copy for the whole batch: a sync point, once per step.
    tokens = logits.argmax(dim=-1).tolist()
    for row, (param, generator) in enumerate(zip(params, generators)):
        if param.greedy:
            continue
        scores = logits[row].float() / param.temperature
        if param.top_k > 0:
            kth = torch.topk(scores, min(param.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if param.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
            drop = cumulative - torch.softmax(ordered, dim=-1) >= param.top_p  # keep >= 1 token
            scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
        probs = torch.softmax(scores, dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
