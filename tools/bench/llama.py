"""The benchmark model of shared/BENCHMARKS.md: a Llama-style decoder in plain PyTorch.

Pre-norm ``nn.RMSNorm``, fused QKV, ``F.scaled_dot_product_attention(is_causal=True)``, SwiGLU
(one ``up`` linear of 2×ffn, one ``down``), untied embedding and LM head, no biases; the loss is
cross-entropy in fp32 on the logits. Sizes and the FLOP count are those of BENCHMARKS.md, so
numbers measured here compare with the table there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Width, depth and vocabulary of one benchmark model."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int = 32000

    def flops_per_token(self, seq: int, params: int) -> float:
        """6·N for the weights' matmuls plus 12·L·hidden·seq for attention, counted in full."""
        return 6.0 * params + 12.0 * self.layers * self.hidden * seq


SHAPES: dict[str, LlamaShape] = {
    "1.3b": LlamaShape(hidden=2048, layers=24, heads=16, ffn=5504),
    "7b": LlamaShape(hidden=4096, layers=32, heads=32, ffn=11008),
    "13b": LlamaShape(hidden=5120, layers=40, heads=40, ffn=13824),
    # For CPU smoke runs of the harness; not a benchmark size.
    "tiny": LlamaShape(hidden=64, layers=2, heads=4, ffn=128, vocab=256),
}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA with a causal mask over the whole (local) sequence."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    """One decoder layer: attention and SwiGLU MLP, each behind an RMSNorm and a residual."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.attn_norm = nn.RMSNorm(shape.hidden)
        self.qkv = nn.Linear(shape.hidden, 3 * shape.hidden, bias=False)
        self.proj = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(shape.hidden)
        self.up = nn.Linear(shape.hidden, 2 * shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, shape.hidden, bias=False)
        # Causal attention on [batch, heads, seq, head_dim]; train_bench --sp wraps it in
        # slipstream.comm.sequence.DistributedAttention (Ulysses).
        self.attend: Any = causal_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = self.attend(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden))
        gate, value = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * value)


class Llama(nn.Module):
    """Embedding, ``layers`` blocks, final norm and an untied LM head; forward returns the loss."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
