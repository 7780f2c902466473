"""Autograd-correct collectives that move activations into and out of tensor-parallel regions.

Each function is the identity when ``group`` is None or has one rank, so a model built with the
tensor-parallel layers runs unchanged without tensor parallelism. The pairs are duals: the
backward of one is the forward of the other (Megatron-LM's "f" and "g" operators and their
sequence-parallel variants).

[Note: why the copy/reduce pair is needed]
A column-parallel linear reads the same replicated input on every rank and produces a slice of
the output. In backward each rank computes only its slice's contribution to the input's
gradient, so the input gradient is the *sum* over ranks: ``copy_to_tensor_parallel_region``
is the identity forward and an all-reduce backward. A row-parallel linear produces partial sums
of the full output: ``reduce_from_tensor_parallel_region`` all-reduces forward and passes the
(replicated) gradient through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import collectives

__all__ = [
    "copy_to_tensor_parallel_region",
    "gather_flat_from_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "split_flat_to_tensor_parallel_region",
    "tensor_parallel_rank",
    "tensor_parallel_world_size",
]


def tensor_parallel_world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 when ``group`` is None (no tensor parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def tensor_parallel_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in ``group``; 0 when ``group`` is None."""
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if tensor_parallel_world_size(group) == 1:
        return tensor
    tensor = tensor.contiguous()
    collectives.all_reduce(tensor, group=group)
    return tensor


def _split(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous chunk of ``tensor`` along ``dim`` (sizes must divide)."""
    world = tensor_parallel_world_size(group)
    if world == 1:
        return tensor
    size = tensor.shape[dim]
    if size % world:
        raise ValueError(
            f"cannot split dimension {dim} of size {size} over {world} tensor-parallel ranks; "
            f"make it a multiple of {world}"
        )
    return tensor.chunk(world, dim=dim)[tensor_parallel_rank(group)].contiguous()


def _gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order)."""
    world = tensor_parallel_world_size(group)
    if world == 1:
        return tensor
    # The collective concatenates along dim 0: move `dim` to the front and back again.
    front = tensor.movedim(dim, 0).contiguous()
    out = torch.empty(
        (world * front.shape[0], *front.shape[1:]), dtype=front.dtype, device=front.device
    )
    collectives.all_gather_into_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(
    tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Sum over ranks, keeping this rank's chunk along ``dim``."""
    world = tensor_parallel_world_size(group)
    if world == 1:
        return tensor
    front = tensor.movedim(dim, 0).contiguous()
    if front.shape[0] % world:
        raise ValueError(
            f"cannot reduce-scatter dimension {dim} of size {front.shape[0]} over {world} "
            f"tensor-parallel ranks; make the sequence length a multiple of {world}"
        )
    out = torch.empty(
        (front.shape[0] // world, *front.shape[1:]), dtype=front.dtype, device=front.device
    )
    collectives.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(tensor.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    # All-gather forward; backward reduce-scatters, because the gathered activation feeds a
    # column-parallel linear whose input gradient is a partial sum on every rank.
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (enters a column-parallel op)."""
    if tensor_parallel_world_size(group) == 1:
        return tensor
    return _CopyToRegion.apply(tensor, group)  # type: ignore[no-any-return]


def reduce_from_tensor_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """All-reduce forward (sums partial outputs); identity backward."""
    if tensor_parallel_world_size(group) == 1:
        return tensor
    return _ReduceFromRegion.apply(tensor, group)  # type: ignore[no-any-return]


def scatter_to_tensor_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1
) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` (last by default); all-gather backward."""
    if tensor_parallel_world_size(group) == 1:
        return tensor
    return _ScatterToRegion.apply(tensor, dim % tensor.dim(), group)  # type: ignore[no-any-return]


def gather_from_tensor_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1
) -> torch.Tensor:
    """All-gather the ranks' chunks along ``dim`` (last by default); split backward."""
    if tensor_parallel_world_size(group) == 1:
        return tensor
    return _GatherFromRegion.apply(tensor, dim % tensor.dim(), group)  # type: ignore[no-any-return]


def scatter_to_sequence_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dimension (``dim``, 1 for ``[batch, seq, ...]``)."""
    return scatter_to_tensor_parallel_region(tensor, group, dim)


def gather_from_sequence_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """All-gather sequence chunks forward; reduce-scatter the gradient backward.

    Used in front of a column-parallel linear under sequence parallelism (the gathered input's
    gradient is a partial sum on each rank).
    """
    if tensor_parallel_world_size(group) == 1:
        return tensor
    return _GatherFromSequenceRegion.apply(tensor, dim % tensor.dim(), group)  # type: ignore[no-any-return]


def reduce_scatter_to_sequence_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """Reduce-scatter partial sums along the sequence dimension forward; all-gather backward.

    Used after a row-parallel linear under sequence parallelism, in place of the all-reduce.
    """
    if tensor_parallel_world_size(group) == 1:
        return tensor
    return _ReduceScatterToSequenceRegion.apply(tensor, dim % tensor.dim(), group)  # type: ignore[no-any-return]


def _flat_chunk(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    world = tensor_parallel_world_size(group)
    flat = tensor.reshape(-1)
    per_rank = -(-flat.numel() // world)
    padded = _pad_to(flat, world * per_rank)
    start = tensor_parallel_rank(group) * per_rank
    return padded[start : start + per_rank].clone()


def _pad_to(flat: torch.Tensor, size: int) -> torch.Tensor:
    """``flat`` zero-padded at the end to ``size`` elements."""
    if flat.numel() == size:
        return flat
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def _flat_gather(
    chunk: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup | None
) -> torch.Tensor:
    full = _gather(chunk, 0, group)
    return full[: shape.numel()].reshape(shape)


class _SplitFlat(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.shape, ctx.group = tensor.shape, group
        return _flat_chunk(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _flat_gather(grad.contiguous(), ctx.shape, ctx.group), None


class _GatherFlat(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, chunk: torch.Tensor, shape: torch.Size, group: Any) -> torch.Tensor:
        ctx.group = group
        return _flat_gather(chunk.contiguous(), shape, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _flat_chunk(grad.contiguous(), ctx.group), None, None


def split_flat_to_tensor_parallel_region(
    tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's 1/tp of a replicated tensor, flattened (zero-padded); all-gather backward.

    With :func:`gather_flat_from_tensor_parallel_region` it partitions a checkpointed
    activation across the group (``activation_checkpointing.partition_activations``). Valid
    for activations that are equal on every rank of the group, whose gradients are too.
    """
    if tensor_parallel_world_size(group) == 1:
        return tensor
    return _SplitFlat.apply(tensor, group)  # type: ignore[no-any-return]


def gather_flat_from_tensor_parallel_region(
    chunk: torch.Tensor, shape: torch.Size, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The whole tensor of ``shape`` from every rank's flat chunk; backward keeps this rank's."""
    if tensor_parallel_world_size(group) == 1:
        return chunk
    return _GatherFlat.apply(chunk, shape, group)  # type: ignore[no-any-return]
