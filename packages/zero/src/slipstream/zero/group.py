"""DataParallelGroup: the ranks that shard among themselves, with the few collectives ZeRO uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from slipstream import comm

__all__ = ["DataParallelGroup"]


@dataclass(frozen=True, slots=True)
class DataParallelGroup:
    """A data-parallel process group (None: the default group), its size and this rank in it.

    Works without torch.distributed initialised: then it is a group of one, and every
    collective is the identity.
    """

    group: dist.ProcessGroup | None
    world_size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> DataParallelGroup:
        """Describe ``group`` (None: the default group, or a single process without one)."""
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise ValueError(
                    "a process group was given but torch.distributed is not initialised; "
                    "call slipstream.comm.init_distributed() first"
                )
            return cls(None, 1, 0)
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def with_max_ctas(self, max_ctas: int) -> tuple[DataParallelGroup, str]:
        """``(the same ranks on a new NCCL communicator that runs each collective on at most
        max_ctas CTAs (NCCL's maxCTAs), "")``, or ``(self, why not)``: a group of one, a
        backend other than NCCL, or a group that is not every rank (creating a communicator
        is collective over all ranks, which only the whole world can promise here).
        """
        if self.world_size == 1:
            return self, "a group of one rank has no collectives"
        backend = dist.get_backend(self.group)
        if backend != "nccl":
            return self, f"the process group's backend is {backend!r}, not 'nccl'"
        if self.world_size != dist.get_world_size():
            return self, "only the group of every rank gets a communicator of its own"
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = max_ctas
        group = dist.new_group(list(range(self.world_size)), backend="nccl", pg_options=options)
        return DataParallelGroup(group, self.world_size, self.rank), ""

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in this group (for broadcast sources)."""
        if self.group is None or self.world_size == 1:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce ``tensor`` in place (sum) over the group; returns it."""
        if self.world_size > 1:
            comm.all_reduce(tensor, group=self.group)
        return tensor

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce ``tensor`` in place (max) over the group; returns it."""
        if self.world_size > 1:
            comm.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast ``tensor`` in place from group rank ``src``; returns it."""
        if self.world_size > 1:
            comm.broadcast(tensor, src=self.global_rank(src), group=self.group)
        return tensor

    def all_gather_into(
        self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False
    ) -> dist.Work | None:
        """Gather every rank's ``shard`` into ``output`` (``world_size * shard.numel()``)."""
        if self.world_size == 1:
            output.copy_(shard.reshape(-1))
            return None
        return comm.all_gather_into_tensor(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter_into(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        async_op: bool = False,
        *,
        average: bool = False,
    ) -> dist.Work | None:
        """Sum ``full`` over ranks (``average``: their mean, ``ReduceOp.AVG``, which gloo
        lacks) and keep this rank's ``output.numel()`` piece of it."""
        if self.world_size == 1:
            output.copy_(full.reshape(-1))
            return None
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        return comm.reduce_scatter_tensor(output, full, op=op, group=self.group, async_op=async_op)
