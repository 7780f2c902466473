"""Pure-torch gated activation: ``act(gate) * up`` for a fused gate/up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """One of :data:`ACTIVATIONS` applied to ``x``."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"gated_activation: activation must be one of {ACTIVATIONS}, got {name!r}")


def gated_activation(x: torch.Tensor, name: str = "silu") -> torch.Tensor:
    """``act(x[..., :n]) * x[..., n:]`` for ``x`` of last dimension ``2n`` (SwiGLU / GeGLU)."""
    if x.shape[-1] % 2:
        raise ValueError(f"gated_activation: last dimension must be even, got {x.shape[-1]}")
    gate, up = x.chunk(2, dim=-1)
    return activation(name, gate) * up
