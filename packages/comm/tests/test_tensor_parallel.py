"""Tensor-parallel layers equal the unsplit layers, forward and backward (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.comm.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
    reduce_sequence_parallel_gradients,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from slipstream.comm.testing import run_distributed

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _chunk(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return tensor.chunk(world, dim=dim)[rank]


def _check_layers() -> None:
    import torch.distributed as dist

    from slipstream.comm.topology import PipeModelDataParallelTopology, ProcessGrid

    grid = ProcessGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    group, rank, world = grid.group("tensor"), dist.get_rank(), 2
    assert group is not None

    # Column -> Row MLP equals the unsplit MLP; the shards are the unsplit init sliced.
    torch.manual_seed(0)
    up = ColumnParallelLinear(8, 12, group=group)
    down = RowParallelLinear(12, 8, group=group)
    torch.manual_seed(0)
    ref_up, ref_down = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8)
    torch.testing.assert_close(up.weight, _chunk(ref_up.weight, 0, rank, world), **TOL)
    torch.testing.assert_close(down.weight, _chunk(ref_down.weight, 1, rank, world), **TOL)
    assert (up.weight.tp_partition_dim, up.weight.tp_size, up.weight.tp_rank) == (0, 2, rank)
    assert down.weight.tp_partition_dim == 1 and not hasattr(down.bias, "tp_partition_dim")
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = down(F.gelu(up(xs)))
    ref = ref_down(F.gelu(ref_up(xr)))
    torch.testing.assert_close(out, ref, **TOL)
    (out * torch.arange(8.0)).sum().backward()
    (ref * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **TOL)
    torch.testing.assert_close(up.weight.grad, _chunk(ref_up.weight.grad, 0, rank, world), **TOL)
    torch.testing.assert_close(up.bias.grad, _chunk(ref_up.bias.grad, 0, rank, world), **TOL)
    torch.testing.assert_close(
        down.weight.grad, _chunk(ref_down.weight.grad, 1, rank, world), **TOL
    )
    torch.testing.assert_close(down.bias.grad, ref_down.bias.grad, **TOL)

    # gather_output / input_is_parallel=False, and from_linear keeps the module's values.
    col = ColumnParallelLinear.from_linear(ref_up, group, gather_output=True)
    row = RowParallelLinear.from_linear(ref_down, group, input_is_parallel=False)
    torch.testing.assert_close(col(x), ref_up(x), **TOL)
    torch.testing.assert_close(row(ref_up(x)), ref_down(ref_up(x)), **TOL)

    # Vocab-parallel embedding (padding row on rank 1's shard) and cross-entropy.
    torch.manual_seed(2)
    emb = VocabParallelEmbedding(10, 4, padding_idx=7, group=group)
    torch.manual_seed(2)
    ref_emb = torch.nn.Embedding(10, 4, padding_idx=7)
    ids = torch.tensor([[0, 7, 9, 4, 5], [1, 2, 3, 6, 8]])
    e, re = emb(ids), ref_emb(ids)
    torch.testing.assert_close(e, re, **TOL)
    (e * 3).sum().backward()
    (re * 3).sum().backward()
    torch.testing.assert_close(emb.weight.grad, _chunk(ref_emb.weight.grad, 0, rank, world), **TOL)

    logits = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(3))
    target = torch.tensor([[0, 9, 4, -100, 5], [1, 2, 3, 6, 8]])
    full = logits.clone().requires_grad_()
    mine = _chunk(logits, -1, rank, world).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, group)
    ref_loss = F.cross_entropy(full.reshape(-1, 10), target.reshape(-1))
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(mine.grad, _chunk(full.grad, -1, rank, world), **TOL)
    none = vocab_parallel_cross_entropy(mine.detach(), target, group, reduction="none")
    ref_none = F.cross_entropy(logits.reshape(-1, 10), target.reshape(-1), reduction="none")
    torch.testing.assert_close(none.reshape(-1), ref_none, **TOL)

    # Sequence parallelism: each rank holds half the sequence around the norm; the layers
    # gather/reduce-scatter along it. Equals the unsplit block, norm gradients included.
    torch.manual_seed(4)
    norm = torch.nn.LayerNorm(8)
    sp_up = ColumnParallelLinear(8, 12, group=group, sequence_parallel=True)
    sp_down = RowParallelLinear(12, 8, group=group, sequence_parallel=True)
    torch.manual_seed(4)
    ref_norm, ref_up2, ref_down2 = (
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 12),
        torch.nn.Linear(12, 8),
    )
    for p in norm.parameters():
        mark_sequence_parallel(p)
    x6 = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(5))
    local = sp_down(F.gelu(sp_up(norm(scatter_to_sequence_parallel_region(x6, group)))))
    out = gather_from_sequence_parallel_region(local.detach(), group)
    ref = ref_down2(F.gelu(ref_up2(ref_norm(x6))))
    torch.testing.assert_close(out, ref, **TOL)
    local.sum().backward()
    ref.sum().backward()
    reduce_sequence_parallel_gradients([*norm.parameters(), sp_down.bias], group)
    torch.testing.assert_close(norm.weight.grad, ref_norm.weight.grad, **TOL)
    torch.testing.assert_close(sp_down.bias.grad, ref_down2.bias.grad, **TOL)
    torch.testing.assert_close(
        sp_up.weight.grad, _chunk(ref_up2.weight.grad, 0, rank, world), **TOL
    )

    # Shapes that do not divide name the problem.
    with pytest.raises(ValueError, match="out_features = 7 is not divisible"):
        ColumnParallelLinear(8, 7, group=group)
    with pytest.raises(ValueError, match="vocabulary size"):
        VocabParallelEmbedding(9, 4, group=group)


def test_tensor_parallel_layers_equal_unsplit_layers() -> None:
    run_distributed(_check_layers, world_size=2)


def test_layers_without_a_group_are_the_plain_layers() -> None:
    torch.manual_seed(0)
    col = ColumnParallelLinear(4, 6)
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 6)
    x = torch.randn(2, 4)
    torch.testing.assert_close(col(x), ref(x))
    logits, target = torch.randn(5, 7), torch.tensor([0, 3, 6, -100, 2])
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(logits, target, None), F.cross_entropy(logits, target)
    )
