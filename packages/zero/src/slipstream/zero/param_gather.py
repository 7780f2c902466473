"""All-gather updated master shards back into the full model parameters (stages 1 and 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.layout import ShardSpec

__all__ = [
    "PendingPublish",
    "copy_out",
    "gather_bucket",
    "gather_packed",
    "pack_bucket",
    "plan_gather_buckets",
    "start_gather",
]


def plan_gather_buckets(
    specs: Sequence[ShardSpec], bucket_numel: int, apart: Sequence[bool] | None = None
) -> list[list[int]]:
    """Parameter indices in order, grouped into all-gathers of at most ``bucket_numel``
    elements; a bucket never holds two parameters whose ``apart`` flags differ."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, spec in enumerate(specs):
        split = apart is not None and bool(current) and apart[current[-1]] != apart[index]
        if current and (split or size + spec.padded_numel > bucket_numel):
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += spec.padded_numel
    if current:
        buckets.append(current)
    return buckets


@torch.no_grad()
def gather_bucket(
    shards: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: DataParallelGroup,
    indices: Sequence[int],
) -> None:
    """One all-gather: every rank's ``shards[i]`` for ``i`` in ``indices`` into ``params[i]``.

    The shards are concatenated into one send buffer in the model's dtype (so half the bytes
    travel), gathered into ``[world, bucket_shard]`` and each parameter is copied out of its
    column range. Host shards (optimizer offload) are uploaded here in their own dtype,
    pinned ones asynchronously, and cast on the device: the CPU step then writes no
    model-dtype copy of its fp32 masters.
    """
    gather_packed(pack_bucket(shards, params, indices), params, specs, group, indices)


@torch.no_grad()
def pack_bucket(
    shards: Sequence[torch.Tensor | Sequence[torch.Tensor]],
    params: Sequence[torch.Tensor],
    indices: Sequence[int],
) -> torch.Tensor:
    """The send buffer of :func:`gather_bucket`: ``shards[i]`` for ``i`` in ``indices``,
    concatenated on the parameters' device in their dtype (host shards uploaded on the
    current stream, then cast there). A shard may also be given as a sequence of 1-D
    pieces, in order (part of it in host memory, part already on the device)."""
    dtype = params[indices[0]].dtype
    device = params[indices[0]].device
    pieces: list[list[torch.Tensor]] = []
    for i in indices:
        shard = shards[i]
        parts = [shard] if isinstance(shard, torch.Tensor) else list(shard)
        pieces.append([part.detach().reshape(-1) for part in parts])
    send = torch.empty(sum(p.numel() for ps in pieces for p in ps), dtype=dtype, device=device)
    offset = 0
    into: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for shard_pieces in pieces:
        for piece in shard_pieces:
            target = send[offset : offset + piece.numel()]
            offset += piece.numel()
            if piece.device != device and piece.dtype == dtype:
                # Already in the model's dtype (staged copies): straight into the send
                # buffer, no device temporary and no cast.
                target.copy_(piece, non_blocking=True)
                continue
            if piece.device != device:
                piece = piece.to(device, non_blocking=True)
            elif piece.is_cuda and len(shard_pieces) > 1:
                # Kept on the device by gpu_share's step, allocated on its stream: not
                # reused before this copy (on the current stream) has read it.
                piece.record_stream(torch.cuda.current_stream(device))
            into.append(target)
            sources.append(piece)
    if into:
        # One multi-tensor copy (cast) for the bucket instead of one kernel per piece
        # ([Note: cast copies] in grad_reduce.py).
        torch._foreach_copy_(into, sources)
    return send


@torch.no_grad()
def gather_packed(
    send: torch.Tensor,
    params: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: DataParallelGroup,
    indices: Sequence[int],
) -> None:
    """The all-gather of a :func:`pack_bucket` buffer into ``params[i]`` for ``i`` in
    ``indices``."""
    start_gather(send, params, specs, group, indices, async_op=False).finish()


class PendingPublish:
    """One bucket's all-gather of updated shards, possibly in flight; :meth:`finish` waits
    for it (on a GPU the compute stream waits, the host does not) and copies each
    parameter out of its column range."""

    def __init__(
        self,
        send: torch.Tensor,
        out: torch.Tensor,
        work: Any,
        params: Sequence[torch.Tensor],
        specs: Sequence[ShardSpec],
        world: int,
        indices: Sequence[int],
    ) -> None:
        self.send, self.out, self.work = send, out, work
        self.params, self.specs, self.world = params, specs, world
        self.indices = list(indices)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the collective and write the gathered values into the parameters."""
        if self.work is not None:
            self.work.wait()
        rows = self.out.view(self.world, self.send.numel())
        copy_out(
            rows, [self.params[i] for i in self.indices], [self.specs[i] for i in self.indices]
        )
        del self.out, self.send


@torch.no_grad()
def copy_out(
    rows: torch.Tensor, params: Sequence[torch.Tensor], specs: Sequence[ShardSpec]
) -> None:
    """Write each parameter's columns of gathered ``rows`` (``[world, sum of shards]``) into it.

    One ``split_with_sizes_copy`` for the whole bucket, straight into the parameters seen as
    ``[world, shard]`` (a parameter with padding, or of another dtype, gets a scratch out and
    one more copy). Before: per parameter a strided column slice made contiguous by
    ``reshape`` and then copied again, two kernels and twice the bytes each.
    """
    world = rows.shape[0]
    outs: list[torch.Tensor] = []
    late: list[tuple[torch.Tensor, torch.Tensor, ShardSpec]] = []
    for param, spec in zip(params, specs):
        data = param.data
        direct = (
            spec.padded_numel == spec.numel
            and data.dtype == rows.dtype
            and data.device == rows.device
            and data.is_contiguous()
        )
        if direct:
            outs.append(data.view(world, spec.shard_numel))
        else:
            scratch = torch.empty(world, spec.shard_numel, dtype=rows.dtype, device=rows.device)
            outs.append(scratch)
            late.append((data, scratch, spec))
    torch.split_with_sizes_copy(rows, [spec.shard_numel for spec in specs], dim=1, out=outs)
    for data, scratch, spec in late:
        data.copy_(scratch.view(-1)[: spec.numel].view(spec.shape))


@torch.no_grad()
def start_gather(
    send: torch.Tensor,
    params: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: DataParallelGroup,
    indices: Sequence[int],
    async_op: bool = True,
) -> PendingPublish:
    """Launch the all-gather of a :func:`pack_bucket` buffer; finish() lands it."""
    out = torch.empty(group.world_size * send.numel(), dtype=send.dtype, device=send.device)
    work = group.all_gather_into(out, send, async_op=async_op)
    return PendingPublish(send, out, work, params, specs, group.world_size, indices)
