"""AutoTP for a FusedDecoder: each rank keeps its slice of every block, one all-reduce per branch.

Column-parallel: QKV (whole heads per rank) and up/gate (a slice of each); row-parallel: the
output and down projections, whose partial sums one all-reduce adds (their bias kept on rank 0
only). The embedding and the LM head are vocab-parallel. Works for every adapter's layout
because the FusedDecoder is the same for all families (no per-architecture policy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slipstream.inference.model import FusedBlock, FusedDecoder

__all__ = ["VocabParallelEmbedding", "shard_decoder"]


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of an embedding table; an all-reduce joins the ranks."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group
        # The group's sum (tensor_parallel.allreduce); None: dist.all_reduce on the group.
        self.reducer: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0)
        if self.reducer is not None:
            return self.reducer(out)
        dist.all_reduce(out, group=self.group)
        return out


def _split(size: int, world: int, what: str) -> int:
    if size % world:
        raise ValueError(
            f"tensor_parallel.tp_size = {world} does not divide the model's {what} ({size}); "
            "choose a tp_size that divides it"
        )
    return size // world


def _rows(tensor: torch.Tensor | None, parts: list[int], rank: int, world: int, dim: int = 0):
    """Rank ``rank``'s slice of each consecutive part (sizes ``parts`` along ``dim``), joined."""
    if tensor is None:
        return None
    pieces = tensor.split(parts, dim=dim)
    return torch.cat([p.chunk(world, dim=dim)[rank] for p in pieces], dim=dim).contiguous()


def _shard_attention(block: FusedBlock, rank: int, world: int) -> None:
    heads, kv_heads, hd = block.heads, block.kv_heads, block.spec.head_dim
    local_heads = _split(heads, world, "attention heads")
    weight, bias = block.qkv.weight.detach(), block.qkv.bias
    q_w, k_w, v_w = weight.split([heads * hd, kv_heads * hd, kv_heads * hd])
    q_b = k_b = v_b = None
    if bias is not None:
        q_b, k_b, v_b = bias.detach().split([heads * hd, kv_heads * hd, kv_heads * hd])
    if kv_heads % world == 0:
        local_kv = kv_heads // world
        kv_pick = slice(rank * local_kv * hd, (rank + 1) * local_kv * hd)
    elif world % kv_heads == 0:
        # Fewer KV heads than ranks (multi-query, or GQA at high TP): each rank keeps the one KV
        # head its query heads read, replicated across the ranks that share it.
        local_kv = 1
        head = rank // (world // kv_heads)
        kv_pick = slice(head * hd, (head + 1) * hd)
    else:
        raise ValueError(
            f"tensor_parallel.tp_size = {world} and the model's {kv_heads} KV heads: one must "
            "divide the other"
        )
    q_pick = slice(rank * local_heads * hd, (rank + 1) * local_heads * hd)
    out_features = (local_heads + 2 * local_kv) * hd
    block.qkv = nn.Linear(block.qkv.in_features, out_features, bias=bias is not None, device="meta")
    block.qkv.weight = nn.Parameter(torch.cat([q_w[q_pick], k_w[kv_pick], v_w[kv_pick]]))
    if bias is not None:
        assert q_b is not None and k_b is not None and v_b is not None
        block.qkv.bias = nn.Parameter(torch.cat([q_b[q_pick], k_b[kv_pick], v_b[kv_pick]]))
    _row_parallel(block.out, rank, world)
    block.heads, block.kv_heads = local_heads, local_kv


def _row_parallel(linear: nn.Linear, rank: int, world: int) -> None:
    _split(linear.in_features, world, f"{linear.in_features} input features")
    linear.weight = nn.Parameter(linear.weight.detach().chunk(world, dim=1)[rank].contiguous())
    linear.in_features //= world
    if linear.bias is not None and rank != 0:
        linear.bias = None  # type: ignore[assignment]  # the all-reduce adds rank 0's bias once


def _shard_mlp(block: FusedBlock, rank: int, world: int) -> None:
    spec = block.spec
    _split(spec.intermediate_size, world, "intermediate size")
    if block.moe is not None:
        moe, inter = block.moe, spec.intermediate_size
        moe.gate_up = nn.Parameter(_rows(moe.gate_up.detach(), [inter, inter], rank, world, 1))
        moe.down = nn.Parameter(moe.down.detach().chunk(world, dim=2)[rank].contiguous())
        return
    parts = [spec.intermediate_size] * (2 if spec.mlp == "gated" else 1)
    block.up.weight = nn.Parameter(_rows(block.up.weight.detach(), parts, rank, world))
    if block.up.bias is not None:
        block.up.bias = nn.Parameter(_rows(block.up.bias.detach(), parts, rank, world))
    block.up.out_features //= world
    _row_parallel(block.down, rank, world)


def shard_decoder(model: FusedDecoder, group: dist.ProcessGroup | None = None) -> FusedDecoder:
    """Keep this rank's slice of ``model`` (in place) for tensor parallelism over ``group``.

    Every rank must hold the same full weights beforehand (as after loading one checkpoint).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return model
    for block in model.blocks:
        assert isinstance(block, FusedBlock)
        _shard_attention(block, rank, world)
        _shard_mlp(block, rank, world)
        block.tp_group = group if group is not None else dist.group.WORLD
    vocab = _split(model.spec.vocab_size, world, "vocabulary size")
    head = model.head.weight.detach().chunk(world)[rank].contiguous()
    model.head = nn.Linear(model.spec.hidden_size, vocab, bias=False, device="meta")
    model.head.weight = nn.Parameter(head)
    model.head_group = group if group is not None else dist.group.WORLD
    table = model.embed.weight.detach().chunk(world)[rank].contiguous()
    model.embed = VocabParallelEmbedding(table, rank * vocab, model.head_group)  # type: ignore[assignment]
    return model
