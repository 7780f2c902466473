"""torch.distributed collectives with the same signatures, reporting to the comms logger.

Each wrapper takes torch's arguments plus two keyword-only ones from DeepSpeed: ``prof=True``
records this call even when ``prof_all`` is off, and ``log_name`` records it under another name.
With the logger disabled a wrapper costs one attribute check over the torch call.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm.comms_logger import comms_logger
from slipstream.comm.in_flight import hold

__all__ = [
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "recv",
    "reduce_scatter_tensor",
    "send",
]

_SUM = dist.ReduceOp.SUM

# torch 2.13 renamed these two (the old names warn); older releases have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _optional(**kwargs: Any) -> dict[str, Any]:
    # Newer torch arguments (group_src, timeout, ...) are forwarded only when given, so the
    # wrappers keep working on torch 2.4, which lacks them.
    return {key: value for key, value in kwargs.items() if value is not None}


def all_reduce(
    tensor: torch.Tensor,
    op: Any = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> dist.Work | None:
    """:func:`torch.distributed.all_reduce`, logged (size: the tensor)."""
    tensor = hold(tensor)  # see [Note: why collectives hold their tensors until exit]
    if not comms_logger.enabled:
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return comms_logger.run_logged(
        "all_reduce",
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        num_bytes=_nbytes(tensor),
        group=group,
        async_op=async_op,
        prof=prof,
        log_name=log_name,
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> dist.Work | None:
    """:func:`torch.distributed.all_gather_into_tensor`, logged (size: the gathered output)."""
    output_tensor, input_tensor = hold(output_tensor), hold(input_tensor)
    if not comms_logger.enabled:
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
    return comms_logger.run_logged(
        "all_gather_into_tensor",
        lambda: _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op),
        num_bytes=_nbytes(output_tensor),
        group=group,
        async_op=async_op,
        prof=prof,
        log_name=log_name,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = _SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> dist.Work | None:
    """:func:`torch.distributed.reduce_scatter_tensor`, logged (size: the full input)."""
    output, input = hold(output), hold(input)
    if not comms_logger.enabled:
        return _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return comms_logger.run_logged(
        "reduce_scatter_tensor",
        lambda: _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op),
        num_bytes=_nbytes(input),
        group=group,
        async_op=async_op,
        prof=prof,
        log_name=log_name,
    )


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> dist.Work | None:
    """:func:`torch.distributed.broadcast`, logged (size: the tensor)."""
    tensor = hold(tensor)
    extra = _optional(group_src=group_src)
    if not comms_logger.enabled:
        return dist.broadcast(tensor, src, group=group, async_op=async_op, **extra)
    return comms_logger.run_logged(
        "broadcast",
        lambda: dist.broadcast(tensor, src, group=group, async_op=async_op, **extra),
        num_bytes=_nbytes(tensor),
        group=group,
        async_op=async_op,
        prof=prof,
        log_name=log_name,
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> dist.Work | None:
    """:func:`torch.distributed.all_to_all_single`, logged (size: this rank's input)."""
    output, input = hold(output), hold(input)

    def call() -> dist.Work | None:
        return dist.all_to_all_single(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
        )

    if not comms_logger.enabled:
        return call()
    return comms_logger.run_logged(
        "all_to_all_single",
        call,
        num_bytes=_nbytes(input),
        group=group,
        async_op=async_op,
        prof=prof,
        log_name=log_name,
    )


def barrier(
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: datetime.timedelta | None = None,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> dist.Work | None:
    """:func:`torch.distributed.barrier`, logged (size 0: latency only)."""
    extra = _optional(device_ids=device_ids, timeout=timeout)
    if group is not None:
        extra["group"] = group
    if not comms_logger.enabled:
        return dist.barrier(async_op=async_op, **extra)
    return comms_logger.run_logged(
        "barrier",
        lambda: dist.barrier(async_op=async_op, **extra),
        num_bytes=0,
        group=group,
        async_op=async_op,
        prof=prof,
        log_name=log_name,
    )


def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> None:
    """:func:`torch.distributed.send`, logged (size: the tensor)."""
    tensor = hold(tensor)
    extra = _optional(group_dst=group_dst)
    if not comms_logger.enabled:
        dist.send(tensor, dst, group=group, tag=tag, **extra)
        return
    comms_logger.run_logged(
        "send",
        lambda: dist.send(tensor, dst, group=group, tag=tag, **extra),
        num_bytes=_nbytes(tensor),
        group=group,
        prof=prof,
        log_name=log_name,
    )


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
    *,
    prof: bool = False,
    log_name: str | None = None,
) -> int:
    """:func:`torch.distributed.recv`, logged (size: the tensor); returns the sender's rank."""
    tensor = hold(tensor)
    extra = _optional(group_src=group_src)
    if not comms_logger.enabled:
        return dist.recv(tensor, src, group=group, tag=tag, **extra)
    return comms_logger.run_logged(
        "recv",
        lambda: dist.recv(tensor, src, group=group, tag=tag, **extra),
        num_bytes=_nbytes(tensor),
        group=group,
        prof=prof,
        log_name=log_name,
    )
