"""Pure-torch attention-score softmax with optional scale, mask and causal masking."""

from __future__ import annotations

import torch


def causal_keep_mask(
    query_len: int, key_len: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean ``(query_len, key_len)`` mask, True where query ``i`` may see key ``j``.

    Aligned to the bottom right: query ``i`` sees keys ``0 .. i + key_len - query_len``, so the
    last query sees every key (decoding with a KV cache). For ``query_len == key_len`` this is
    the usual lower triangle. Queries with nothing to see (``query_len > key_len``) get an
    all-False row.
    """
    ones = torch.ones(query_len, key_len, dtype=torch.bool, device=device)
    return torch.tril(ones, diagonal=key_len - query_len)


def softmax(
    scores: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax over the last dimension of ``scale * scores`` after masking, in ``scores.dtype``.

    Args:
        scores: ``(..., queries, keys)`` attention scores (any shape when ``causal`` is False).
        scale: multiplies the scores first (e.g. ``head_dim ** -0.5``); None means 1.
        causal: mask keys after each query, bottom-right aligned (see :func:`causal_keep_mask`).
        mask: broadcastable to ``scores``; boolean (True = keep, as in
            ``F.scaled_dot_product_attention``) or additive float (added after scaling).

    A row whose every entry is masked comes out as zeros (not NaN, which ``torch.softmax``
    gives), as attention kernels do. Computed in fp32 for half-precision inputs;
    differentiable through torch's autograd.
    """
    if causal and scores.dim() < 2:
        raise ValueError(
            f"softmax: causal masking needs (..., queries, keys) scores, got shape "
            f"{tuple(scores.shape)}"
        )
    compute_dtype = torch.promote_types(scores.dtype, torch.float32)
    logits = scores.to(compute_dtype)
    if scale is not None:
        logits = logits * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            logits = logits + mask.to(compute_dtype)
    if causal:
        keep = causal_keep_mask(scores.shape[-2], scores.shape[-1], device=scores.device)
        logits = logits.masked_fill(~keep, float("-inf"))
    # Subtracting a finite row maximum keeps exp() in range; for fully masked rows the maximum
    # is -inf, replaced by 0 so that exp(-inf - 0) = 0 and the row sums to 0 instead of NaN.
    row_max = logits.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    exponentials = torch.exp(logits - row_max)
    totals = exponentials.sum(dim=-1, keepdim=True)
    totals = torch.where(totals == 0, torch.ones_like(totals), totals)
    return (exponentials / totals).to(scores.dtype)
