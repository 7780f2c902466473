"""Pure-torch residual add followed by RMSNorm (the two steps a pre-norm block runs back to back)."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.rms_norm.reference import rms_norm


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``total = x + residual`` (in ``x.dtype``) and ``rms_norm(total, weight, eps)``."""
    if x.shape != residual.shape:
        raise ValueError(
            f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} must match"
        )
    total = x + residual
    return total, rms_norm(total, weight, eps)
