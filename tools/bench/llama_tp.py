"""The benchmark Llama (llama.py) built from slipstream.comm's tensor-parallel layers.

Same shapes, parameter count and FLOPs as :class:`llama.Llama`, split over a tensor-parallel
group Megatron-style: Q, K, V and the SwiGLU gate/up are column-parallel (each rank holds
``heads / tp`` heads and ``ffn / tp`` of the MLP), the attention output and ``down`` are
row-parallel, the embedding is vocab-parallel, and the LM head is column-parallel feeding
``vocab_parallel_cross_entropy`` (no rank ever holds the full-vocabulary logits).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from llama import LlamaShape
from torch import nn

from slipstream.comm.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


class TensorParallelBlock(nn.Module):
    """One decoder layer with its attention heads and MLP split over ``group``."""

    def __init__(self, shape: LlamaShape, group: dist.ProcessGroup | None, tp: int) -> None:
        super().__init__()
        self.local_heads = shape.heads // tp
        self.attn_norm = nn.RMSNorm(shape.hidden)
        self.q = ColumnParallelLinear(shape.hidden, shape.hidden, bias=False, group=group)
        self.k = ColumnParallelLinear(shape.hidden, shape.hidden, bias=False, group=group)
        self.v = ColumnParallelLinear(shape.hidden, shape.hidden, bias=False, group=group)
        self.proj = RowParallelLinear(shape.hidden, shape.hidden, bias=False, group=group)
        self.mlp_norm = nn.RMSNorm(shape.hidden)
        self.gate = ColumnParallelLinear(shape.hidden, shape.ffn, bias=False, group=group)
        self.up = ColumnParallelLinear(shape.hidden, shape.ffn, bias=False, group=group)
        self.down = RowParallelLinear(shape.ffn, shape.hidden, bias=False, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            proj(h).view(batch, seq, self.local_heads, -1).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TensorParallelLlama(nn.Module):
    """:class:`llama.Llama` split over ``group``; forward returns the mean token loss."""

    def __init__(self, shape: LlamaShape, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        tp = 1 if group is None else dist.get_world_size(group)
        for name, value in (("heads", shape.heads), ("ffn", shape.ffn), ("vocab", shape.vocab)):
            if value % tp:
                raise SystemExit(f"--tp {tp} does not divide the model's {name} = {value}")
        self.group = group
        self.embed = VocabParallelEmbedding(shape.vocab, shape.hidden, group=group)
        self.blocks = nn.ModuleList(
            TensorParallelBlock(shape, group, tp) for _ in range(shape.layers)
        )
        self.norm = nn.RMSNorm(shape.hidden)
        self.head = ColumnParallelLinear(shape.hidden, shape.vocab, bias=False, group=group)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.group)
