"""A Llama-style decoder as a list of layer specs, ready for PipelineModule.

Pre-norm RMSNorm, fused QKV, causal ``scaled_dot_product_attention``, SwiGLU MLP, no biases
(the model of the project's benchmarks). Used by the tests and ``tools/bench/pipeline_bench.py``,
and as an example of writing a model for pipelining: every layer takes and returns one tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.pipeline.module import LayerSpec, TiedLayerSpec

__all__ = [
    "DecoderBlock",
    "Embedding",
    "FinalNorm",
    "LMHead",
    "decoder_layer_specs",
    "language_model_loss",
    "tied_lm_head",
]


class Embedding(nn.Module):
    """Token embedding: ``(batch, seq)`` ids to ``(batch, seq, hidden)``."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab_size, hidden) * 0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look the ids up."""
        return F.embedding(input_ids, self.weight)


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention and a SwiGLU MLP, each residual."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float = 0.0) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.heads = heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        shape = (batch, seq, self.heads, hidden // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(batch, seq, hidden)))
        gate, value = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.dropout(self.down(F.silu(gate) * value))


class FinalNorm(nn.RMSNorm):
    """The RMSNorm before the output head."""


class LMHead(nn.Module):
    """Untied output projection to vocabulary logits."""

    def __init__(self, hidden: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab_size, hidden) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return F.linear(x, self.weight)


def tied_lm_head(embedding: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Output head sharing the embedding matrix (``forward_fn`` of a TiedLayerSpec)."""
    weight = embedding.weight
    assert isinstance(weight, torch.Tensor)
    return F.linear(x, weight)


def language_model_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32 over ``(batch, seq, vocab)`` logits."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def decoder_layer_specs(
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    ffn: int,
    tie_embeddings: bool = False,
    dropout: float = 0.0,
) -> list[LayerSpec]:
    """The decoder as ``[embedding, block × layers, final norm, head]`` specs.

    >>> specs = decoder_layer_specs(vocab_size=32, hidden=16, layers=2, heads=2, ffn=32)
    >>> [type(s).__name__ for s in specs][:2], len(specs)
    (['LayerSpec', 'LayerSpec'], 5)
    """
    if tie_embeddings:
        first: LayerSpec = TiedLayerSpec("embed", Embedding, vocab_size, hidden)
        last: LayerSpec = TiedLayerSpec(
            "embed", Embedding, vocab_size, hidden, forward_fn=tied_lm_head
        )
    else:
        first, last = (
            LayerSpec(Embedding, vocab_size, hidden),
            LayerSpec(LMHead, hidden, vocab_size),
        )
    blocks = [LayerSpec(DecoderBlock, hidden, heads, ffn, dropout) for _ in range(layers)]
    return [first, *blocks, LayerSpec(FinalNorm, hidden), last]
