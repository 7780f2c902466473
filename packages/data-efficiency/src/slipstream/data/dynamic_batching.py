"""Dynamic batching: micro-batches packed by token count, spread over ranks, with LR scaling.

[Note: dynamic batching layout]
As DeepSpeed's ``batch_by_seqlens`` does: samples are visited in ``sequence_picking_order``
(the dataset's order, a seeded shuffle, or ascending length) and packed greedily into
micro-batches whose summed length stays within ``max_tokens`` and whose size stays within
``min/max_batch_size``; a sample longer than ``max_tokens`` alone is left out (with a warning).
Every ``dp_size × gradient_accumulation_steps`` consecutive micro-batches form one global batch
(a trailing incomplete one is dropped) and rank ``r`` takes micro-batches ``r, r + dp, ...`` of
it, so every rank runs the same number of micro-batches per step. The LR of each step is the
base LR scaled by that global batch's sample count against the configured batch size
(``linear``: ×n/base, ``sqrt``: ×√(n/base), ``none``).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator, Sequence
from typing import Any, Literal

__all__ = ["DynamicBatchSampler", "batch_by_seqlens", "scale_lr"]

logger = logging.getLogger(__name__)

PickingOrder = Literal["dataloader", "random", "seqlen"]


def batch_by_seqlens(
    seqlens: Sequence[int],
    max_tokens: int,
    *,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    sequence_picking_order: PickingOrder = "dataloader",
    seed: int = 0,
) -> list[list[int]]:
    """Sample ids packed into micro-batches of at most ``max_tokens`` summed length."""
    order = list(range(len(seqlens)))
    if sequence_picking_order == "random":
        random.Random(seed).shuffle(order)
    elif sequence_picking_order == "seqlen":
        order.sort(key=lambda i: (seqlens[i], i))
    elif sequence_picking_order != "dataloader":
        raise ValueError(
            f"sequence_picking_order = {sequence_picking_order!r}; use 'dataloader', 'random' "
            "or 'seqlen'"
        )
    too_long = [i for i in order if seqlens[i] > max_tokens]
    if too_long:
        logger.warning(
            "dynamic batching: %d samples are longer than max_tokens=%d and are left out "
            "(first ids: %s)",
            len(too_long),
            max_tokens,
            too_long[:8],
        )
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index in order:
        length = seqlens[index]
        if length > max_tokens:
            continue
        full = tokens + length > max_tokens or (
            max_batch_size is not None and len(current) >= max_batch_size
        )
        if full and current:
            if len(current) >= min_batch_size:
                batches.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += length
    if current and len(current) >= min_batch_size:
        batches.append(current)
    return batches


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float, method: str) -> float:
    """The LR for a global batch of ``batch_size`` samples, given ``base_lr`` at the base size."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method.lower() == "none":
        return base_lr
    raise ValueError(f"lr_scaling_method = {method!r}; use 'linear', 'sqrt' or 'none'")


class DynamicBatchSampler:
    """A ``batch_sampler`` for one data-parallel rank: its micro-batches of each global batch.

    Every rank builds the same packing (same seed and epoch), so the ranks agree without
    communication. Epoch ``e`` packs with seed ``seed + e`` (for ``random`` order); iterating
    past the end starts the next epoch. ``state_dict``/``load_state_dict`` carry the epoch and
    the position, so a resumed run continues with the same micro-batches.
    """

    def __init__(
        self,
        seqlens: Sequence[int],
        max_tokens: int,
        *,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        gradient_accumulation_steps: int = 1,
        min_batch_size: int = 1,
        max_batch_size: int | None = None,
        sequence_picking_order: PickingOrder = "dataloader",
        seed: int = 0,
    ) -> None:
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} of {data_parallel_size}")
        self.seqlens = list(seqlens)
        self.max_tokens = max_tokens
        self.rank = data_parallel_rank
        self.size = data_parallel_size
        self.gas = gradient_accumulation_steps
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.order: PickingOrder = sequence_picking_order
        self.seed = seed
        self.epoch = 0
        self.position = 0  # global batches of this epoch already handed out

    def global_batches(self, epoch: int | None = None) -> list[list[list[int]]]:
        """The epoch's global batches, each a list of ``dp × gas`` micro-batches (all ranks)."""
        micro = batch_by_seqlens(
            self.seqlens,
            self.max_tokens,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            sequence_picking_order=self.order,
            seed=self.seed + (self.epoch if epoch is None else epoch),
        )
        per_step = self.size * self.gas
        count = len(micro) // per_step
        if count == 0:
            raise ValueError(
                f"dynamic batching made {len(micro)} micro-batches, fewer than one global batch "
                f"({per_step} = data-parallel size × gradient_accumulation_steps); lower "
                "max_tokens or add data"
            )
        return [micro[i * per_step : (i + 1) * per_step] for i in range(count)]

    def batch_sizes(self) -> list[int]:
        """Samples in each global batch of the current epoch (what the LR scaling reads)."""
        return [sum(len(mb) for mb in batch) for batch in self.global_batches()]

    def __len__(self) -> int:
        return len(self.global_batches()) * self.gas

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            batches = self.global_batches()
            while self.position < len(batches):
                batch = batches[self.position]
                self.position += 1
                # Interleaved: rank r takes micro-batches r, r + dp, ... of the global batch.
                yield from batch[self.rank :: self.size]
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """Epoch and position (global batches handed out this epoch)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
