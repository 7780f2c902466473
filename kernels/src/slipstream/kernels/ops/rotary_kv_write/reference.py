"""Pure-torch fused attention input step: split QKV, rotate Q and K, write K and V to the cache."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.rotary_embedding.reference import rotary_embedding


def check_shapes(
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> int:
    """Validate the arguments of :func:`rotary_kv_write`; returns ``head_dim``."""
    if qkv.dim() != 3:
        raise ValueError(
            f"rotary_kv_write: qkv must be (batch, tokens, features), got {tuple(qkv.shape)}"
        )
    batch, length, features = qkv.shape
    head_dim = key_cache.shape[-1]
    if features != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"rotary_kv_write: qkv has {features} features, expected (num_heads {num_heads} + "
            f"2 * num_kv_heads {num_kv_heads}) * head_dim {head_dim}"
        )
    expected_cache = (batch, num_kv_heads, key_cache.shape[2], head_dim)
    if tuple(key_cache.shape) != expected_cache or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"rotary_kv_write: caches must be (batch, kv_heads, slots, head_dim) = "
            f"{expected_cache}, got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if slots.shape != (length,):
        raise ValueError(f"rotary_kv_write: slots must be ({length},), got {tuple(slots.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("rotary_kv_write: pass both cos and sin, or neither")
    if cos is not None and (cos.shape[:2] != (batch, length) or 2 * cos.shape[-1] > head_dim):
        raise ValueError(
            f"rotary_kv_write: cos/sin must be (batch {batch}, tokens {length}, rotary_dim / 2 <= "
            f"{head_dim // 2}), got {tuple(cos.shape)}"
        )
    return head_dim


def rotary_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    pdl: bool = False,
) -> torch.Tensor:
    """Split a fused QKV projection, rotate queries and keys, store keys and values in the cache.
    (``pdl``, a GPU launch option, changes nothing here.)

    Args:
        qkv: ``(batch, tokens, (num_heads + 2 * num_kv_heads) * head_dim)``: queries, keys,
            values, head by head.
        cos, sin: ``(batch, tokens, rotary_dim // 2)`` (GPT-NeoX "rotate half" layout, the first
            ``rotary_dim`` features of each head rotated), or None for no rotary.
        key_cache, value_cache: ``(batch, num_kv_heads, slots, head_dim)``, written in place at
            ``slots`` (``(tokens,)``, the cache slot of each token).

    Returns the rotated queries ``(batch, num_heads, tokens, head_dim)``, contiguous (so that
    grouped-query heads view as ``(batch, num_kv_heads, group * tokens, head_dim)``).
    """
    head_dim = check_shapes(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads)
    batch, length, _ = qkv.shape
    heads = qkv.view(batch, length, num_heads + 2 * num_kv_heads, head_dim)
    qk = heads[:, :, : num_heads + num_kv_heads]
    if cos is not None and sin is not None:
        qk = rotary_embedding(qk, cos[:, :, None], sin[:, :, None])
    q = qk[:, :, :num_heads].transpose(1, 2).contiguous()
    key_cache.index_copy_(2, slots, qk[:, :, num_heads:].transpose(1, 2).to(key_cache.dtype))
    values = heads[:, :, num_heads + num_kv_heads :].transpose(1, 2)
    value_cache.index_copy_(2, slots, values.to(value_cache.dtype))
    return q
