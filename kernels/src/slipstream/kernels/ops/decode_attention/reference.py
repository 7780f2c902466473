"""Pure-torch decode attention: a few query rows per KV head over a static KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise unless ``query`` is ``(batch, kv_heads, rows, head_dim)`` and ``key``/``value``
    ``(batch, kv_heads, slots, head_dim)``."""
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ValueError(
            "decode_attention: query must be (batch, kv_heads, rows, head_dim) and key/value "
            f"(batch, kv_heads, slots, head_dim), got {tuple(query.shape)}, {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    if query.shape[:2] != key.shape[:2] or query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"decode_attention: query {tuple(query.shape)} and key {tuple(key.shape)} must agree "
            "on batch, kv_heads and head_dim"
        )


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    pdl: bool = False,
    trigger: bool | str = False,
    prefetch: bool = False,
    new_slots: torch.Tensor | None = None,
    weights: tuple[torch.Tensor, ...] = (),
    weights_when: str = "waited",
) -> torch.Tensor:
    """``softmax(query @ key^T * scale + mask) @ value`` per KV head: ``(batch, kv_heads, rows,
    head_dim)``. ``rows`` are the query heads of one GQA group (times the tokens); ``mask`` is
    additive (0 / -inf) and broadcasts to ``(batch, kv_heads, rows, slots)``. (``pdl``, ``trigger``,
    ``prefetch``, ``new_slots``, ``weights`` and ``weights_when``, GPU launch options, change
    nothing here.)"""
    check_shapes(query, key, value)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
