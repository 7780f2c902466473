"""Pure-torch expert-indexed GEMV: each row multiplied by the weight of its own expert."""

from __future__ import annotations

import torch


def moe_gemv(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[r] = weights[experts[r]] @ x[r]``: ``x`` ``(rows, K)``, ``experts`` ``(rows,)``
    integer ids, ``weights`` ``(E, N, K)``; returns ``(rows, N)`` in ``x.dtype`` (fp32 sums)."""
    if x.dim() != 2 or weights.dim() != 3 or experts.shape != (x.shape[0],):
        raise ValueError(
            f"moe_gemv: expected x (rows, K), experts (rows,), weights (E, N, K); got "
            f"{tuple(x.shape)}, {tuple(experts.shape)}, {tuple(weights.shape)}"
        )
    if weights.shape[2] != x.shape[1]:
        raise ValueError(
            f"moe_gemv: weights have K = {weights.shape[2]}, x has {x.shape[1]} features"
        )
    picked = weights[experts.long()].float()  # (rows, N, K)
    return torch.bmm(picked, x.float()[:, :, None]).squeeze(-1).to(x.dtype)
