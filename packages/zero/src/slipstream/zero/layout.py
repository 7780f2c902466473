"""Where each rank's shard of a parameter lies: the flat, padded, per-parameter layout.

Every sharded tensor (a parameter at stage 3, its fp32 master copy, its gradient and its
optimizer state at stages 1-3) is laid out the same way: flattened, padded with zeros to a
multiple of the data-parallel world size ``N``, and cut into ``N`` equal pieces; rank ``r``
owns elements ``[r * s, (r + 1) * s)`` with ``s = ceil(numel / N)``. One layout for all stages
is what makes a checkpoint written at one stage and world size loadable at another: a
shard is a plain range of the flattened parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ShardSpec"]


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """The shard layout of one tensor of ``shape`` over ``world_size`` ranks.

    >>> spec = ShardSpec(torch.Size([3, 3]), world_size=4)
    >>> spec.shard_numel, spec.padded_numel, spec.valid_range(3)
    (3, 12, (9, 9))
    """

    shape: torch.Size
    world_size: int

    @property
    def numel(self) -> int:
        """Elements of the full (unsharded) tensor."""
        return math.prod(self.shape)

    @property
    def shard_numel(self) -> int:
        """Elements each rank holds (padding included)."""
        return max(1, math.ceil(self.numel / self.world_size))

    @property
    def padded_numel(self) -> int:
        """Elements of the flattened, padded tensor: ``shard_numel * world_size``."""
        return self.shard_numel * self.world_size

    def valid_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, end)`` of real (non-padding) elements rank ``rank`` owns, as flat indices."""
        start = min(rank * self.shard_numel, self.numel)
        return start, min(start + self.shard_numel, self.numel)

    def shard_of(
        self, full: torch.Tensor, rank: int, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A new tensor with rank ``rank``'s shard of ``full`` (zero padded), in ``dtype``."""
        start, end = self.valid_range(rank)
        shard = torch.zeros(self.shard_numel, dtype=dtype or full.dtype, device=full.device)
        if end > start:
            shard[: end - start].copy_(full.detach().reshape(-1)[start:end])
        return shard

    def padded_view(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (``padded_numel`` elements) seen as ``[world_size, shard_numel]``."""
        return flat.view(self.world_size, self.shard_numel)
