"""The rest of ``deepspeed.comm``'s names, so that ``from slipstream import comm as dist`` works.

The timed, logged collectives live in :mod:`slipstream.comm.collectives`; the names here are
``torch.distributed``'s own (DeepSpeed's wrappers of them add only its comms logging), plus
DeepSpeed's capability probes and older aliases.

>>> from slipstream import comm as dist
>>> dist.ReduceOp.SUM is torch.distributed.ReduceOp.SUM
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed import (
    P2POp,
    ProcessGroup,
    ReduceOp,
    all_gather,
    all_gather_object,
    all_to_all,
    batch_isend_irecv,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_global_rank,
    irecv,
    isend,
    monitored_barrier,
    new_group,
    reduce,
    reduce_scatter,
    scatter,
)

from slipstream.comm.collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor

__all__ = [
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_object",
    "all_to_all",
    "allgather_fn",
    "batch_isend_irecv",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_world_group",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "irecv",
    "is_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "scatter",
]


def is_available() -> bool:
    """Whether ``torch.distributed`` is built into this torch (``deepspeed.comm.is_available``)."""
    return torch_dist.is_available()


def get_world_group() -> ProcessGroup:
    """The default (world) process group."""
    return torch_dist.group.WORLD  # type: ignore[return-value]


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return list(torch_dist.get_process_group_ranks(group or get_world_group()))


def has_all_gather_into_tensor() -> bool:
    """True: every supported torch has ``all_gather_into_tensor``."""
    return True


def has_reduce_scatter_tensor() -> bool:
    """True: every supported torch has ``reduce_scatter_tensor``."""
    return True


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    debug: Any = None,
) -> Any:
    """DeepSpeed's name for a flat all-gather: :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    debug: Any = None,
) -> Any:
    """DeepSpeed's name for a flat reduce-scatter: :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup | None = None
) -> Any:
    """DeepSpeed's inference all-reduce (a fused kernel there): :func:`all_reduce` here."""
    return all_reduce(tensor, op=op, group=group)
