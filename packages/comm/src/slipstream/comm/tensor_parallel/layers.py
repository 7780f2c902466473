"""Megatron-style tensor-parallel layers: column/row-parallel linears and a vocab-parallel embedding.

Every layer takes the tensor-parallel ``group`` (``ProcessGrid.group("tensor")``; None means no
tensor parallelism) and initialises its shard as the slice of the unsplit layer that
``torch.nn.Linear``/``torch.nn.Embedding`` would draw from the same RNG state, so a reference
built after the same ``torch.manual_seed`` holds exactly the concatenation of the shards. That
costs one full-size temporary per layer at construction; build big models on the ``meta``
device and load their weights, or convert existing modules with ``from_linear`` /
``from_embedding``.

Each sharded parameter carries its layout for checkpoints (see docs/tensor-parallel.md):

- ``tp_partition_dim``: the dimension split across the group (0 for column-parallel weights
  and biases and the embedding's rows, 1 for row-parallel weights);
- ``tp_size`` and ``tp_rank``: the group size and this shard's index (shards are contiguous,
  in rank order).

A parameter without ``tp_partition_dim`` is replicated across the group. Under sequence
parallelism, replicated parameters that see only this rank's sequence chunk (the row-parallel
bias, norms the user marks with :func:`mark_sequence_parallel`) get
``sequence_parallel = True``: their gradients are partial sums that
:func:`reduce_sequence_parallel_gradients` all-reduces over the group after backward.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slipstream.comm import collectives
from slipstream.comm.tensor_parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    tensor_parallel_rank,
    tensor_parallel_world_size,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "gather_tensor_parallel_state_dict",
    "mark_sequence_parallel",
    "reduce_sequence_parallel_gradients",
    "set_tensor_parallel_attributes",
]


def set_tensor_parallel_attributes(
    param: torch.Tensor, partition_dim: int, group: dist.ProcessGroup | None
) -> None:
    """Record on ``param`` that it is this rank's shard along ``partition_dim`` of ``group``."""
    param.tp_partition_dim = partition_dim  # type: ignore[attr-defined]
    param.tp_size = tensor_parallel_world_size(group)  # type: ignore[attr-defined]
    param.tp_rank = tensor_parallel_rank(group)  # type: ignore[attr-defined]


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """Mark a replicated parameter that sees only this rank's sequence chunk (a norm's weight)."""
    param.sequence_parallel = True  # type: ignore[attr-defined]


def reduce_sequence_parallel_gradients(
    params: Iterable[torch.Tensor], group: dist.ProcessGroup | None
) -> None:
    """All-reduce (sum) the gradients of parameters marked ``sequence_parallel`` over ``group``.

    Call after backward and before the optimizer step (the engine does it for its model).
    """
    if tensor_parallel_world_size(group) == 1:
        return
    for param in params:
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            collectives.all_reduce(param.grad, group=group)


def _shard_size(total: int, group: dist.ProcessGroup | None, what: str) -> int:
    world = tensor_parallel_world_size(group)
    if total % world:
        raise ValueError(
            f"{what} = {total} is not divisible by the tensor-parallel size {world}; choose a "
            f"tensor-parallel size that divides it (or pad {what} to a multiple of {world})"
        )
    return total // world


def _slice(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = tensor_parallel_world_size(group)
    return tensor.detach().chunk(world, dim=dim)[tensor_parallel_rank(group)].clone()


class ColumnParallelLinear(torch.nn.Module):
    """``y = x Aᵀ + b`` with ``A`` split by output rows: each rank computes a slice of ``y``.

    Args:
        in_features, out_features: the unsplit layer's sizes (``out_features`` must divide by
            the group size).
        bias: add a bias (split like the output).
        group: the tensor-parallel process group (None: no tensor parallelism).
        gather_output: all-gather the output slices into the full ``y`` (for a last layer);
            otherwise each rank returns its slice, for a following :class:`RowParallelLinear`.
        sequence_parallel: the input is this rank's chunk of the sequence dimension
            (``sequence_dim``); it is all-gathered first (reduce-scattered in backward).
        sequence_dim: the sequence dimension of the input (1 for ``[batch, seq, hidden]``).

    >>> layer = ColumnParallelLinear(8, 16, group=grid.group("tensor"))  # doctest: +SKIP
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _shard_size(out_features, group, "out_features")
        full = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._adopt(full, group, gather_output, sequence_parallel, sequence_dim)

    def _adopt(
        self,
        full: torch.nn.Linear,
        group: dist.ProcessGroup | None,
        gather_output: bool,
        sequence_parallel: bool,
        sequence_dim: int,
    ) -> None:
        self.group = group
        self.in_features = full.in_features
        self.out_features = full.out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.weight = torch.nn.Parameter(
            _slice(full.weight, 0, group), requires_grad=full.weight.requires_grad
        )
        set_tensor_parallel_attributes(self.weight, 0, group)
        if full.bias is not None:
            self.bias: torch.nn.Parameter | None = torch.nn.Parameter(
                _slice(full.bias, 0, group), requires_grad=full.bias.requires_grad
            )
            set_tensor_parallel_attributes(self.bias, 0, group)
        else:
            self.bias = None

    @classmethod
    def from_linear(
        cls,
        linear: torch.nn.Linear,
        group: dist.ProcessGroup | None,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> ColumnParallelLinear:
        """This rank's shard of an existing ``nn.Linear`` (its values are kept, sliced)."""
        _shard_size(linear.out_features, group, "out_features")
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer._adopt(linear, group, gather_output, sequence_parallel, sequence_dim)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output slice (or, with ``gather_output``, the whole output)."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.group, self.sequence_dim)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(torch.nn.Module):
    """``y = x Aᵀ + b`` with ``A`` split by input columns: each rank adds a partial sum of ``y``.

    Args:
        in_features, out_features: the unsplit layer's sizes (``in_features`` must divide by
            the group size).
        bias: add a bias (replicated, added once after the reduction).
        group: the tensor-parallel process group (None: no tensor parallelism).
        input_is_parallel: the input is already this rank's slice of the last dimension (the
            output of a :class:`ColumnParallelLinear`); otherwise it is split here.
        sequence_parallel: reduce-scatter the partial sums along ``sequence_dim`` (each rank
            keeps its sequence chunk) instead of all-reducing them.
        sequence_dim: the sequence dimension of the output (1 for ``[batch, seq, hidden]``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group: dist.ProcessGroup | None = None,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _shard_size(in_features, group, "in_features")
        full = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._adopt(full, group, input_is_parallel, sequence_parallel, sequence_dim)

    def _adopt(
        self,
        full: torch.nn.Linear,
        group: dist.ProcessGroup | None,
        input_is_parallel: bool,
        sequence_parallel: bool,
        sequence_dim: int,
    ) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear(sequence_parallel=True) needs input_is_parallel=True: under "
                "sequence parallelism its input comes from a ColumnParallelLinear"
            )
        self.group = group
        self.in_features = full.in_features
        self.out_features = full.out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        self.weight = torch.nn.Parameter(
            _slice(full.weight, 1, group), requires_grad=full.weight.requires_grad
        )
        set_tensor_parallel_attributes(self.weight, 1, group)
        if full.bias is not None:
            self.bias: torch.nn.Parameter | None = torch.nn.Parameter(
                full.bias.detach().clone(), requires_grad=full.bias.requires_grad
            )
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.bias = None

    @classmethod
    def from_linear(
        cls,
        linear: torch.nn.Linear,
        group: dist.ProcessGroup | None,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> RowParallelLinear:
        """This rank's shard of an existing ``nn.Linear`` (its values are kept, sliced)."""
        _shard_size(linear.in_features, group, "in_features")
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer._adopt(linear, group, input_is_parallel, sequence_parallel, sequence_dim)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output (or, under sequence parallelism, this rank's sequence chunk)."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group, self.sequence_dim)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding table split by rows (the vocabulary) across the tensor-parallel group.

    Each rank looks up the ids in its vocabulary range (zeros for the others) and the partial
    embeddings are summed over the group, so the output is the unsplit lookup.

    Args:
        num_embeddings: the vocabulary size (must divide by the group size).
        embedding_dim: the hidden size.
        padding_idx: as in ``torch.nn.Embedding`` (its row starts at zero and gets no gradient).
        group: the tensor-parallel process group (None: no tensor parallelism).
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` instead of
            all-reducing it (each rank keeps its sequence chunk).
        sequence_dim: the sequence dimension of the output (1 for ``[batch, seq]`` ids).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _shard_size(num_embeddings, group, "num_embeddings (the vocabulary size)")
        full = torch.nn.Embedding(
            num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype
        )
        self._adopt(full, group, sequence_parallel, sequence_dim)

    def _adopt(
        self,
        full: torch.nn.Embedding,
        group: dist.ProcessGroup | None,
        sequence_parallel: bool,
        sequence_dim: int,
    ) -> None:
        self.group = group
        self.num_embeddings = full.num_embeddings
        self.embedding_dim = full.embedding_dim
        self.sequence_parallel = sequence_parallel
        self.sequence_dim = sequence_dim
        per_rank = self.num_embeddings // tensor_parallel_world_size(group)
        self.vocab_start = tensor_parallel_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.padding_idx = full.padding_idx
        self.weight = torch.nn.Parameter(
            _slice(full.weight, 0, group), requires_grad=full.weight.requires_grad
        )
        set_tensor_parallel_attributes(self.weight, 0, group)

    @classmethod
    def from_embedding(
        cls,
        embedding: torch.nn.Embedding,
        group: dist.ProcessGroup | None,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> VocabParallelEmbedding:
        """This rank's shard of an existing ``nn.Embedding`` (its values are kept, sliced)."""
        _shard_size(embedding.num_embeddings, group, "num_embeddings (the vocabulary size)")
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError(
                "VocabParallelEmbedding.from_embedding does not support max_norm or sparse "
                "embeddings; build the embedding without them"
            )
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer._adopt(embedding, group, sequence_parallel, sequence_dim)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``ids`` (or, under sequence parallelism, this rank's chunk)."""
        world = tensor_parallel_world_size(self.group)
        if world == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        padding = None
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            padding = self.padding_idx - self.vocab_start
        partial = F.embedding(local, self.weight, padding)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(
                partial, self.group, self.sequence_dim
            )
        return reduce_from_tensor_parallel_region(partial, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:"
            f"{self.vocab_end}), padding_idx={self.padding_idx}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


def gather_tensor_parallel_state_dict(
    module: torch.nn.Module, group: dist.ProcessGroup | None
) -> dict[str, torch.Tensor]:
    """The unsplit ``state_dict`` of a tensor-parallel module (collective over ``group``).

    Every tensor that is a shard (``tp_partition_dim`` set) is all-gathered along its
    partition dimension; replicated tensors are returned as they are. Every rank of the group
    must call it and gets the whole dict (one parameter at a time moves, so peak memory is the
    whole model plus one parameter). Tied tensors appear under each of their names.
    """
    sharded = {id(p): p for p in module.parameters() if hasattr(p, "tp_partition_dim")}
    world = tensor_parallel_world_size(group)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        param = sharded.get(id(tensor))
        if param is None or world == 1:
            out[name] = tensor.detach()
            continue
        dim = int(param.tp_partition_dim)  # type: ignore[attr-defined]
        front = tensor.detach().movedim(dim, 0).contiguous()
        full = torch.empty(
            (world * front.shape[0], *front.shape[1:]), dtype=front.dtype, device=front.device
        )
        collectives.all_gather_into_tensor(full, front, group=group)
        out[name] = full.movedim(0, dim).contiguous()
    return out
