"""Optimizer parameter groups and gradient reduction for models with expert-parallel layers.

[Note: which group reduces which gradient]
Every rank trains on its own tokens, so the loss is the mean over all ``W`` ranks. A dense
parameter is replicated: its gradient is all-reduced over the world and divided by ``W``. An
expert's gradient on one rank already holds the contributions of every token its EP group routed
to it (the all-to-all's backward brings them home); the ranks that own the same expert are its
expert-DP group, so the gradient is all-reduced over that group and also divided by ``W`` (the
number of per-rank losses averaged), not by the expert-DP size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream import comm
from slipstream.moe.groups import get_expert_data_parallel_group, get_expert_parallel_group

__all__ = [
    "allreduce_gradients",
    "clip_grad_norm_",
    "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]

# DeepSpeed's default cap on the elements of one MoE parameter group.
_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (marked ``allreduce = False`` by :class:`slipstream.moe.MoE`)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
    params: Iterable[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dense, expert)`` lists from `params`, order kept."""
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for param in params:
        (expert if is_moe_param(param) else dense).append(param)
    return dense, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: nn.Module | Mapping[str, Any] | Sequence[Mapping[str, Any]],
    max_group_size: int | None = _MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Optimizer param groups with expert parameters moved into their own groups.

    Each input group keeps its dense parameters; its expert parameters go to one new group per
    expert group name (``ep_size_<E>``) with the same hyperparameters plus ``"moe": True`` and
    ``"name": <group name>``, split further so that none holds more than `max_group_size`
    elements (None: no cap). Groups left empty are dropped. A module stands for one group of
    all its parameters.

    >>> model = torch.nn.Sequential(MoE(8, FeedForwardExpert(8, 16), num_experts=2))
    >>> groups = split_params_into_different_moe_groups_for_optimizer(
    ...     [{"params": list(model.parameters()), "lr": 1e-3}])
    >>> [(g.get("name"), g.get("moe", False)) for g in groups]
    [(None, False), ('ep_size_1', True)]
    >>> optimizer = torch.optim.AdamW(groups)
    """
    if isinstance(param_groups, nn.Module):
        groups: list[Mapping[str, Any]] = [{"params": list(param_groups.parameters())}]
    elif isinstance(param_groups, Mapping):
        groups = [param_groups]
    else:
        groups = list(param_groups)
    result: list[dict[str, Any]] = []
    moe_groups: list[dict[str, Any]] = []
    for group in groups:
        if "params" not in group:
            raise ValueError(f"a parameter group needs a 'params' entry; got keys {sorted(group)}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        options = {key: value for key, value in group.items() if key != "params"}
        dense, expert = split_params_into_shared_and_expert_params(params)
        if dense:
            result.append({**options, "params": dense})
        by_name: dict[str, list[torch.Tensor]] = {}
        for param in expert:
            by_name.setdefault(param.group_name, []).append(param)  # type: ignore[attr-defined]
        for name, members in by_name.items():
            for chunk in _chunks(members, max_group_size):
                moe_groups.append({**options, "params": chunk, "name": name, "moe": True})
    return result + moe_groups


def _chunks(params: list[torch.Tensor], max_numel: int | None) -> list[list[torch.Tensor]]:
    if max_numel is None:
        return [params]
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for param in params:
        if chunks[-1] and size + param.numel() > max_numel:
            chunks.append([])
            size = 0
        chunks[-1].append(param)
        size += param.numel()
    return chunks


def allreduce_gradients(
    module: nn.Module | Iterable[torch.Tensor], *, bucket_numel: int = 2**24
) -> None:
    """Average gradients for data parallelism with expert parallelism (what the engine calls
    after backward): dense gradients over the world, expert gradients over their expert-DP
    group, both divided by the world size (see the note at the top of this module).

    Gradients are flattened into buckets of at most `bucket_numel` elements per (group, dtype,
    device), one all-reduce each, logged by comm's logger as ``dense_grad_allreduce`` and
    ``expert_grad_allreduce``. Does nothing without torch.distributed or with one rank.
    """
    if not comm.is_initialized() or comm.get_world_size() == 1:
        return
    params = module.parameters() if isinstance(module, nn.Module) else module
    world_size = comm.get_world_size()
    buckets: dict[tuple[str, torch.dtype, torch.device], list[torch.Tensor]] = {}
    for param in params:
        if param.grad is None:
            continue
        name = param.group_name if is_moe_param(param) else ""  # type: ignore[attr-defined]
        buckets.setdefault((name, param.grad.dtype, param.grad.device), []).append(param.grad)
    for (name, _, _), grads in buckets.items():
        group = get_expert_data_parallel_group(name) if name else None
        log_name = "expert_grad_allreduce" if name else "dense_grad_allreduce"
        for chunk in _chunks(grads, bucket_numel):
            _allreduce_mean(chunk, group, world_size, log_name)


def _allreduce_mean(
    grads: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int, log_name: str
) -> None:
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    comm.all_reduce(flat, group=group, log_name=log_name)
    flat.div_(divisor)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def clip_grad_norm_(
    module: nn.Module | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients by the norm of the *whole* model's gradient, experts of every rank included;
    returns that norm (``torch.nn.utils.clip_grad_norm_``'s contract).

    Call it after :func:`allreduce_gradients`. Dense gradients are then equal on every rank and
    count once; the experts of a layer are spread over its expert-parallel group (each expert on
    one rank of it, replicated across expert-DP groups), so their share of the norm is summed
    over the expert-parallel group. Every rank gets the same norm and the same scale.
    """
    params = list(module.parameters() if isinstance(module, nn.Module) else module)
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].grad.device  # type: ignore[union-attr]
    infinite = norm_type == float("inf")
    shares: dict[str, torch.Tensor] = {}
    for param in grads:
        grad = param.grad.detach().float()  # type: ignore[union-attr]
        part = grad.abs().max() if infinite else grad.abs().pow(norm_type).sum()
        name = param.group_name if is_moe_param(param) else ""  # type: ignore[attr-defined]
        previous = shares.get(name)
        if previous is None:
            shares[name] = part.to(device)
        else:
            shares[name] = torch.maximum(previous, part) if infinite else previous + part
    total = torch.zeros((), device=device)
    for name, share in shares.items():
        group = get_expert_parallel_group(name) if name else None
        if group is not None:
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            comm.all_reduce(share, op=op, group=group, log_name="moe_grad_norm")
        total = torch.maximum(total, share) if infinite else total + share
    norm = total if infinite else total.pow(1.0 / norm_type)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in grads:
        param.grad.detach().mul_(scale.to(param.grad.dtype))  # type: ignore[union-attr]
    return norm
