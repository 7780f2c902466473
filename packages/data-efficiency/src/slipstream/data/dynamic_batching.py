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
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "DynamicBatchSampler",
    "batch_by_seqlens",
    "dataset_seqlens",
    "sample_length",
    "scale_lr",
]

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


def sample_length(sample: Any) -> int:
    """Tokens in one dataset sample: a tensor's or array's last dimension, a sequence's
    length, a mapping's ``input_ids`` (else its first value), a tuple's first element."""
    if isinstance(sample, torch.Tensor | np.ndarray):
        if sample.ndim == 0:
            raise TypeError("a 0-d tensor has no sequence length")
        return int(sample.shape[-1])
    if isinstance(sample, Mapping):
        if not sample:
            raise TypeError("an empty mapping has no sequence length")
        return sample_length(
            sample["input_ids"] if "input_ids" in sample else next(iter(sample.values()))
        )
    if isinstance(sample, str | bytes):
        return len(sample)
    if isinstance(sample, Sequence) and sample:
        first = sample[0]
        if isinstance(first, torch.Tensor | np.ndarray | Mapping | list | tuple):
            return sample_length(first)  # (input_ids, labels, ...)
        return len(sample)  # a list of token ids
    raise TypeError(
        f"cannot tell the sequence length of a {type(sample).__name__} sample; give "
        "data_efficiency.data_sampling.dynamic_batching.metrics_path (the DataAnalyzer's "
        "seqlen metric) or samples that are tensors, token lists or dicts with input_ids"
    )


def dataset_seqlens(dataset: Any, metrics_path: str | None = None) -> list[int]:
    """Every sample's length: from the DataAnalyzer's ``seqlen`` metric under ``metrics_path``
    (``seqlen/seqlen_sample_to_metric``, as DeepSpeed reads it), else measured sample by sample
    (progress logged every ~10%)."""
    count = len(dataset)
    if metrics_path is not None:
        from slipstream.data.indexed import IndexedRows

        rows = IndexedRows(os.path.join(metrics_path, "seqlen", "seqlen_sample_to_metric"))
        values = [int(v) for v in rows.concatenated()]
        if len(values) != count:
            raise ValueError(
                f"the seqlen metric under {metrics_path!r} has {len(values)} samples, the "
                f"dataset {count}: it was computed for another dataset; rerun the DataAnalyzer"
            )
        return values
    lengths = []
    began, next_report = time.monotonic(), max(count // 10, 1)
    for index in range(count):
        lengths.append(sample_length(dataset[index]))
        if count >= 10_000 and (index + 1) % next_report == 0:
            logger.info(
                "dynamic batching: measured %d/%d sample lengths (%.0f s)",
                index + 1,
                count,
                time.monotonic() - began,
            )
    return lengths


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
        self._packed: dict[int, list[list[list[int]]]] = {}

    def global_batches(self, epoch: int | None = None) -> list[list[list[int]]]:
        """The epoch's global batches, each a list of ``dp × gas`` micro-batches (all ranks)."""
        epoch = self.epoch if epoch is None else epoch
        key = 0 if self.order != "random" else epoch  # only a random order differs by epoch
        cached = self._packed.get(key)
        if cached is not None:
            return cached
        micro = batch_by_seqlens(
            self.seqlens,
            self.max_tokens,
            min_batch_size=self.min_batch_size,
            max_batch_size=self.max_batch_size,
            sequence_picking_order=self.order,
            seed=self.seed + epoch,
        )
        per_step = self.size * self.gas
        count = len(micro) // per_step
        if count == 0:
            raise ValueError(
                f"dynamic batching made {len(micro)} micro-batches, fewer than one global batch "
                f"({per_step} = data-parallel size × gradient_accumulation_steps); lower "
                "max_tokens or add data"
            )
        batches = [micro[i * per_step : (i + 1) * per_step] for i in range(count)]
        if len(self._packed) >= 4:  # a random order packs anew each epoch: keep a few
            self._packed.pop(next(iter(self._packed)))
        self._packed[key] = batches
        return batches

    def batch_sizes(self, epoch: int | None = None) -> list[int]:
        """Samples in each global batch of an epoch (the current one by default)."""
        return [sum(len(mb) for mb in batch) for batch in self.global_batches(epoch)]

    def locate(self, index: int) -> tuple[int, int]:
        """``(epoch, position)`` of the ``index``-th global batch since the start (epoch 0)."""
        if index < 0:
            raise ValueError(f"global batch index {index} is negative")
        epoch = 0
        while True:
            count = len(self.global_batches(epoch))
            if index < count:
                return epoch, index
            index -= count
            epoch += 1

    def global_batch_size(self, index: int) -> int:
        """Samples in the ``index``-th global batch since the start (what the LR scaling reads)."""
        epoch, position = self.locate(index)
        return sum(len(mb) for mb in self.global_batches(epoch)[position])

    def seek(self, index: int) -> None:
        """Continue from the ``index``-th global batch (a resumed run's consumed steps)."""
        self.epoch, self.position = self.locate(index)

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
