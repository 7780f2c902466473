"""Tiny models and helpers for ZeRO tests (this package's and the umbrella's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyTransformer", "batch_for", "param_bytes", "two_group_params"]


class _Block(nn.Module):
    """Pre-norm attention + MLP block (single head, causal)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        # No bias: the key bias has a zero gradient in exact arithmetic (softmax is shift
        # invariant), and Adam would turn its round-off noise into lr-sized steps.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class TinyTransformer(nn.Module):
    """A two-block causal LM with the features ZeRO must handle.

    Tied weights (the head is the embedding), a frozen parameter (positions), a module
    called twice per forward (``shared``) and, with ``unused=True``, a parameter that never
    receives a gradient.
    """

    def __init__(self, vocab: int = 32, dim: int = 16, seq: int = 8, unused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1, requires_grad=False)
        self.block = _Block(dim)
        self.shared = _Block(dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.unused = nn.Linear(dim, 2) if unused else None

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]].to(self.embed.weight.dtype)
        h = self.block(h)
        h = self.shared(self.shared(h))  # the same module (and weights) twice
        logits = self.head(self.norm(h)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def batch_for(
    step: int, micro: int, size: int, vocab: int = 32, seq: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (ids, labels) batch of ``size`` sequences for (step, micro-step)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    ids = torch.randint(0, vocab, (size, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def param_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held by the storages behind ``tensors`` (each storage counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def two_group_params(model: nn.Module) -> list[dict]:
    """Two optimizer parameter groups of every tensor of ``model`` (frozen ones too), as the
    offload tests use them: the matrices with weight decay 0.1, the rest (norms) at lr 0.02."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "lr": 0.02}]
