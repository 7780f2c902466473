"""Gradient work after a pipelined batch: tied-weight sums, data-parallel means, global clipping.

Apply in this order after :meth:`PipelineExecutor.run`: :func:`reduce_tied_gradients` (each
stage holds only its share of a tied weight's gradient), then
:func:`allreduce_data_parallel_gradients` (the replicas of a stage average), then
:func:`clip_grad_norm_across_stages` (the norm spans every stage, so it needs the final
gradients), then the optimizer.

With ZeRO on the data axis the gradients end in shards instead (the umbrella's pipeline
engine composes slipstream.zero); :func:`reduce_tied_gradients` takes a ``grad_of`` for them
and :func:`grad_norm_across_stages` measures any (weight, gradient) pairs, over any groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.pipeline.module import PipelineModule

__all__ = [
    "allreduce_data_parallel_gradients",
    "clip_grad_norm_across_stages",
    "grad_norm_across_stages",
    "grad_squares_across_stages",
    "reduce_tied_gradients",
]

# 25 MiB of fp32 per all-reduce, DDP's default bucket: large enough to reach bandwidth, small
# enough that the flat copy stays cheap.
_DEFAULT_BUCKET_NUMEL = 25 * 1024 * 1024 // 4


def reduce_tied_gradients(
    module: PipelineModule, grad_of: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Sum each tied weight's gradient across the stages that share it (collective over the
    tie groups: every rank of the pipeline must call it).

    ``grad_of(weight)``: the tensor to sum in place instead of ``weight.grad`` (a ZeRO
    gradient shard: the tie groups join the same data-parallel coordinate on every stage,
    so the shards cover the same range of the weight).
    """
    module.allreduce_tied_weight_gradients(grad_of)


def allreduce_data_parallel_gradients(
    params: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    bucket_numel: int = _DEFAULT_BUCKET_NUMEL,
) -> None:
    """Average the gradients of ``params`` across the data-parallel ``group``.

    Gradients are flattened into buckets of about ``bucket_numel`` elements per dtype (one
    all-reduce each). A parameter without a gradient contributes zeros, so every replica
    issues the same collectives. Does nothing when the group has one rank.

    >>> allreduce_data_parallel_gradients(model.parameters(), grid.get_data_parallel_group())  # doctest: +SKIP
    """
    world = comm.get_world_size(group) if group is not None else 1
    if world == 1:
        return
    trainable = [p for p in params if p.requires_grad]
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in trainable:
        grad = p.grad
        assert grad is not None
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in grads:
            bucket.append(grad)
            size += grad.numel()
            if size >= bucket_numel:
                _reduce_bucket(bucket, group, world)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, group, world)


def _reduce_bucket(grads: list[torch.Tensor], group: dist.ProcessGroup | None, world: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def grad_squares_across_stages(
    module: PipelineModule,
    grads: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    groups: Sequence[dist.ProcessGroup | None],
    device: torch.device,
    tensor_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The fp32 sum of squares of the whole model's gradient, from this rank's
    ``(weight, gradient)`` pairs; its square root is the global L2 norm.

    A gradient may be the weight's full gradient or this rank's shard of it (ZeRO); each
    tied weight counts once (on its lowest stage). The sum is all-reduced over every group of
    ``groups`` in turn (the pipeline; with sharded gradients, first the data-parallel group),
    so every rank gets the same value. With ``tensor_group`` (stages built from
    tensor-parallel layers), the squares of tensor-parallel shards (weights with
    ``tp_partition_dim`` and ``tp_size > 1``) are also summed over that group, while
    replicated weights (identical on every tensor rank) count once. Collective over those
    groups.

    It is also the step's non-finite vote: an inf or nan in any gradient of any of those
    ranks makes it non-finite on all of them (replicated weights' too: their squares times
    zero ride on the tensor group's all-reduce), so one collective serves both.

    >>> squares = grad_squares_across_stages(module, [(p, p.grad) for p in params], [pipe], dev)  # doctest: +SKIP
    """
    # [sharded squares, replicated squares]: all sums are linear, so the order of the
    # reductions does not matter; only the tensor group is restricted to the shards.
    parts = torch.zeros(2, dtype=torch.float32, device=device)
    for weight, grad in grads:
        if grad is not None and module.tied_weight_owner(weight):
            sharded = (
                getattr(weight, "tp_partition_dim", None) is not None
                and getattr(weight, "tp_size", 1) > 1
            )
            parts[0 if sharded else 1] += grad.detach().float().pow(2).sum().to(device)
    for group in groups:
        if group is not None and comm.get_world_size(group) > 1:
            comm.all_reduce(parts, group=group)
    if tensor_group is not None and comm.get_world_size(tensor_group) > 1:
        # [shards, replicated * 0]: the second is 0, or nan when any tensor rank's replicated
        # squares are not finite (adding it changes no finite sum).
        shared = torch.stack([parts[0], parts[1] * 0.0])
        comm.all_reduce(shared, group=tensor_group)
        return shared[0] + parts[1] + shared[1]
    return parts.sum()


def grad_norm_across_stages(
    module: PipelineModule,
    grads: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    groups: Sequence[dist.ProcessGroup | None],
    device: torch.device,
    tensor_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient from this rank's ``(weight, gradient)``
    pairs: the square root of :func:`grad_squares_across_stages` (same arguments, same
    collectives).

    >>> norm = grad_norm_across_stages(module, [(p, p.grad) for p in params], [pipe], dev)  # doctest: +SKIP
    """
    return grad_squares_across_stages(module, grads, groups, device, tensor_group).sqrt()


def clip_grad_norm_across_stages(
    module: PipelineModule,
    max_norm: float,
    pipe_group: dist.ProcessGroup | None,
    params: Sequence[torch.Tensor] | None = None,
    device: torch.device | None = None,
    tensor_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The L2 norm of the whole model's gradient; scale every stage's gradients to
    ``max_norm`` when it is larger (``max_norm <= 0``: only measure).

    Each tied weight counts once (on its lowest stage). The squares are summed across
    ``pipe_group`` in fp32, so every stage gets the same norm and the same coefficient,
    ``max_norm / (norm + 1e-6)`` clamped at 1, as ``torch.nn.utils.clip_grad_norm_``.
    Collective over the pipeline. ``device``: where to sum (default: the gradients'; give it
    for a stage that may have no gradients under NCCL). ``tensor_group``: the tensor-parallel
    group of stages built from TP layers (see :func:`grad_norm_across_stages`). Returns the
    norm before clipping.
    """
    params = [
        p for p in (params if params is not None else module.parameters()) if p.grad is not None
    ]
    if device is None:
        device = params[0].grad.device if params else torch.device("cpu")  # type: ignore[union-attr]
    total = grad_norm_across_stages(
        module, [(p, p.grad) for p in params], [pipe_group], device, tensor_group=tensor_group
    )
    if max_norm > 0:
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coefficient.to(p.grad.dtype))  # type: ignore[union-attr]
    return total
