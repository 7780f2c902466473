"""Pure-torch rotary position embedding (RoPE) in the GPT-NeoX and GPT-J layouts."""

from __future__ import annotations

import torch


def rotary_cos_sin(
    positions: int | torch.Tensor,
    rotary_dim: int,
    base: float = 10000.0,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``cos``, ``sin`` tables for :func:`rotary_embedding`: ``(positions, rotary_dim // 2)``.

    Frequency ``i`` is ``base ** (-2i / rotary_dim)``. ``positions`` is a count (0..n-1) or a
    1-D tensor of positions. Angles are computed in float64 on the CPU, then cast and moved,
    so long contexts do not lose precision in the table itself.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"rotary_cos_sin: rotary_dim must be a positive even number, got {rotary_dim}"
        )
    if isinstance(positions, int):
        position_values = torch.arange(positions, dtype=torch.float64)
    else:
        position_values = positions.detach().to("cpu", torch.float64).reshape(-1)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inverse_frequencies = base ** (-exponents)
    angles = torch.outer(position_values, inverse_frequencies)
    return (
        angles.cos().to(device=device, dtype=dtype),
        angles.sin().to(device=device, dtype=dtype),
    )


def rotary_embedding(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x`` by the angles in ``cos``/``sin``.

    Args:
        x: ``(..., head_dim)``, e.g. ``(batch, seq, heads, head_dim)``.
        cos, sin: ``(..., rotary_dim // 2)``, broadcastable against ``x[..., :rotary_dim // 2]``;
            for ``x`` of ``(batch, seq, heads, head_dim)`` pass ``(seq, 1, rotary_dim // 2)``,
            for ``(batch, heads, seq, head_dim)`` pass ``(seq, rotary_dim // 2)``.
        interleaved: False for the GPT-NeoX/Llama layout (pairs are feature ``i`` and
            ``i + rotary_dim / 2``: "rotate half"); True for the GPT-J layout (pairs are
            features ``2i`` and ``2i + 1``).

    Features past ``rotary_dim`` pass through (partial rotary). Computed in fp32 for
    half-precision inputs; returns a new tensor in ``x.dtype``.
    """
    if cos.shape != sin.shape:
        raise ValueError(
            f"rotary_embedding: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have "
            "the same shape"
        )
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(
            f"rotary_embedding: cos/sin cover {rotary_dim} features (2 * {half}) but x has only "
            f"{x.shape[-1]} in its last dimension"
        )
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    rotary = x[..., :rotary_dim].to(compute_dtype)
    cos = cos.to(compute_dtype)
    sin = sin.to(compute_dtype)
    if interleaved:
        even, odd = rotary[..., 0::2], rotary[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
        rotated = rotated.flatten(-2)
    else:
        first, second = rotary[..., :half], rotary[..., half:]
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    rotated = rotated.to(x.dtype)
    if rotary_dim < x.shape[-1]:
        rotated = torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    return rotated
