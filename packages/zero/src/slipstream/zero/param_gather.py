"""All-gather updated master shards back into the full model parameters (stages 1 and 2)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.layout import ShardSpec

__all__ = ["gather_shards_into_params"]


def _buckets(specs: Sequence[ShardSpec], bucket_numel: int) -> list[list[int]]:
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, spec in enumerate(specs):
        if current and size + spec.padded_numel > bucket_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += spec.padded_numel
    if current:
        buckets.append(current)
    return buckets


@torch.no_grad()
def gather_shards_into_params(
    shards: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    specs: Sequence[ShardSpec],
    group: DataParallelGroup,
    bucket_numel: int,
) -> None:
    """Write every rank's ``shards[i]`` (cast to ``params[i].dtype``) into ``params[i]``.

    One all-gather per bucket of at most ``bucket_numel`` elements
    (``allgather_bucket_size``): the shards of a bucket are concatenated, gathered into
    ``[world, bucket_shard]`` and each parameter is copied out of its column range. The
    cast to the model's fp16/bf16 happens before the collective, so half the bytes travel.
    """
    for indices in _buckets(specs, bucket_numel):
        dtype = params[indices[0]].dtype
        device = params[indices[0]].device
        # Host shards (optimizer offload) are uploaded here; pinned ones asynchronously.
        send = torch.cat(
            [
                shards[i].detach().to(device=device, dtype=dtype, non_blocking=True).reshape(-1)
                for i in indices
            ]
        )
        out = torch.empty(group.world_size * send.numel(), dtype=dtype, device=device)
        group.all_gather_into(out, send)
        rows = out.view(group.world_size, send.numel())
        offset = 0
        for i in indices:
            spec = specs[i]
            full = rows[:, offset : offset + spec.shard_numel].reshape(-1)[: spec.numel]
            params[i].data.copy_(full.view(spec.shape).to(params[i].dtype))
            offset += spec.shard_numel
