"""Pure-torch decode GEMVs with their neighbours fused in: add + RMSNorm before, SiLU * mul before."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.kernels.ops.add_rms_norm.reference import add_rms_norm
from slipstream.kernels.ops.gated_activation.reference import gated_activation
from slipstream.kernels.ops.rms_norm.reference import rms_norm
from slipstream.kernels.ops.rotary_kv_write.reference import rotary_kv_write


def decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``pdl``, a GPU launch option, changes nothing here)."""
    return F.linear(x, weight, bias)


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, F.linear(rms_norm(total, norm_weight, eps), weight, bias))`` where ``total`` is
    ``x + residual`` (``x`` when ``residual`` is None): a pre-norm block's residual add, its
    norm and the projection after it, as :func:`add_rms_norm` and ``F.linear`` compute them."""
    if residual is None:
        total, normed = x, rms_norm(x, norm_weight, eps)
    else:
        total, normed = add_rms_norm(x, residual, norm_weight, eps)
    return total, F.linear(normed, weight, bias)


def gated_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)`` for ``gate_up = [gate, up]`` along the last
    dimension (:func:`gated_activation`'s SwiGLU, then the down projection)."""
    return F.linear(gated_activation(gate_up, "silu"), weight, bias)


def norm_gemv_rotary(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_gemv` (the QKV projection) then ``rotary_kv_write``: ``(total, q)`` with the
    rotated queries ``(batch, num_heads, tokens, head_dim)``, the keys and values written into
    the caches at ``slots`` (``pdl``, a GPU launch option, changes nothing here)."""
    total, qkv = norm_gemv(x, residual, norm_weight, eps, weight, bias)
    q = rotary_kv_write(qkv, cos, sin, key_cache, value_cache, slots, num_heads, num_kv_heads)
    return total, q
