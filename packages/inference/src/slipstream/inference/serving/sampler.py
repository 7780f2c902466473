"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling, batched."""

from __future__ import annotations

import torch

from slipstream.inference.serving.request import SamplingParams


def filtered_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Sampling probabilities of every row of ``logits`` ``(rows, vocab)`` in one batched pass.

    Per row: scores divided by ``temperature``; then only scores ``>=`` the ``top_k``-th largest
    kept (``top_k`` 0: all); then the smallest set of the highest scores whose probability
    reaches ``top_p`` (always at least one; ``top_p`` 1: all).
    """
    vocab = logits.shape[-1]
    scores = logits.float() / temperature[:, None]
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # A token is dropped when the more likely ones already reach top_p.
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p < 1.0)[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.softmax(torch.empty_like(scores).scatter_(1, order, ordered), dim=-1)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """:func:`sample_tokens` read back to the host: the step's one sync point (the GPU finishes
    the forward here)."""
    return sample_tokens(logits, params, generators).tolist()  # type: ignore[no-any-return]


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of ``logits`` (``(rows, vocab)``), following each row's parameters.

    Greedy rows share one argmax; sampled rows are filtered in one batched pass, unseeded ones
    drawn in one batched call, seeded ones each from its own generator (so that their tokens do
    not depend on what they were batched with). The tokens stay on the logits' device.
    """
    tokens = logits.argmax(dim=-1)
    rows = [row for row, param in enumerate(params) if not param.greedy]
    if rows:
        device = logits.device
        chosen = [params[row] for row in rows]
        probs = filtered_probs(
            logits[rows],
            torch.tensor([p.temperature for p in chosen], device=device),
            torch.tensor([p.top_k for p in chosen], device=device),
            torch.tensor([p.top_p for p in chosen], device=device),
        )
        drawn = torch.empty(len(rows), dtype=tokens.dtype, device=device)
        unseeded = [i for i, row in enumerate(rows) if generators[row] is None]
        if unseeded:
            drawn[unseeded] = torch.multinomial(probs[unseeded], 1)[:, 0]
        for i, row in enumerate(rows):
            if generators[row] is not None:
                drawn[i] = torch.multinomial(probs[i], 1, generator=generators[row])[0]
        tokens[rows] = drawn
    return tokens
