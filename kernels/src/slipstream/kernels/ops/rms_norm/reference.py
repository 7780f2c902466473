"""Pure-torch RMSNorm over the last dimension, computed in fp32."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """``x / sqrt(mean(x^2, last dim) + eps) * weight``, returned in ``x.dtype``.

    Half-precision inputs are normalised and scaled in fp32 and rounded once at the end (Hugging
    Face's Llama rounds before the weight multiply instead; the difference is one rounding).
    Differentiable through torch's autograd.
    """
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight shape {tuple(weight.shape)} must equal the last dimension of x "
            f"{tuple(x.shape[-1:])}"
        )
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    hidden = x.to(compute_dtype)
    inverse_rms = torch.rsqrt(hidden.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = hidden * inverse_rms
    if weight is not None:
        out = out * weight.to(compute_dtype)
    return out.to(x.dtype)
