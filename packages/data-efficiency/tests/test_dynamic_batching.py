"""Dynamic batching: packing within max_tokens, one pass per epoch over 2 ranks, resume, LR scaling."""

from __future__ import annotations

import math
import random

import pytest

from slipstream.data import DynamicBatchSampler, batch_by_seqlens, scale_lr
from slipstream.data.config import DataSamplingConfig
from slipstream.kernels.config_schema import ConfigError

SEQLENS = [random.Random(3).randint(1, 40) for _ in range(200)] + [99]  # the last is too long


@pytest.mark.parametrize("order", ["dataloader", "random", "seqlen"])
def test_micro_batches_respect_max_tokens_and_sizes(order: str) -> None:
    batches = batch_by_seqlens(
        SEQLENS,
        64,
        max_batch_size=5,
        sequence_picking_order=order,
        seed=1,  # type: ignore[arg-type]
    )
    ids = [i for batch in batches for i in batch]
    assert sorted(ids) == list(range(200))  # every sample once, the too-long one left out
    assert all(sum(SEQLENS[i] for i in batch) <= 64 and len(batch) <= 5 for batch in batches)
    if order == "seqlen":
        assert [SEQLENS[i] for i in ids] == sorted(SEQLENS[:200])
    with pytest.raises(ValueError, match="sequence_picking_order"):
        batch_by_seqlens(SEQLENS, 64, sequence_picking_order="longest")  # type: ignore[arg-type]


def _samplers(**kwargs: object) -> list[DynamicBatchSampler]:
    return [
        DynamicBatchSampler(SEQLENS, 64, data_parallel_rank=rank, data_parallel_size=2,
                            gradient_accumulation_steps=2, sequence_picking_order="random",
                            seed=5, **kwargs)  # type: ignore[arg-type]
        for rank in range(2)
    ]  # fmt: skip


def test_two_ranks_cover_the_epoch_once_in_equal_steps_and_resume_identically() -> None:
    ranks = _samplers()
    steps = len(ranks[0].global_batches())
    assert len(ranks[0]) == len(ranks[1]) == 2 * steps
    iterators = [iter(s) for s in ranks]
    epoch = [[next(it) for _ in range(2 * steps)] for it in iterators]
    seen = [i for per_rank in epoch for batch in per_rank for i in batch]
    assert len(seen) == len(set(seen))  # no repeats within the epoch, across both ranks
    packed = {i for batch in ranks[0].global_batches(0) for mb in batch for i in mb}
    assert set(seen) == packed and len(packed) >= 200 - 4 * 5  # only a partial step dropped
    assert all(sum(SEQLENS[i] for i in mb) <= 64 for per_rank in epoch for mb in per_rank)
    # Epoch 1 is a different shuffle.
    next_epoch = [next(iterators[0]) for _ in range(2)]
    assert next_epoch != epoch[0][:2]
    # Resume after 3 steps of epoch 1: the same micro-batches as an uninterrupted run.
    reference = _samplers()[1]
    it = iter(reference)
    for _ in range(2 * steps + 2 * 3):
        next(it)
    resumed = _samplers()[1]
    resumed.load_state_dict(reference.state_dict())
    assert reference.state_dict() == {"epoch": 1, "position": 3}
    assert [next(it) for _ in range(6)] == [b for _, b in zip(range(6), iter(resumed))]


def test_lr_scaling_methods() -> None:
    assert scale_lr(32, 64, 0.1, "linear") == pytest.approx(0.2)
    assert scale_lr(32, 64, 0.1, "sqrt") == pytest.approx(0.1 * math.sqrt(2))
    assert scale_lr(32, 64, 0.1, "none") == 0.1
    with pytest.raises(ValueError, match="lr_scaling_method"):
        scale_lr(32, 64, 0.1, "cubic")


def test_config_keys_are_typed_and_enabled_is_refused_by_name() -> None:
    block = DataSamplingConfig.from_dict(
        {"dynamic_batching": {"enabled": False, "max_tokens": 4096, "lr_scaling_method": "sqrt",
                              "sequence_picking_order": "seqlen", "min_batch_size": 2,
                              "max_batch_size": 16, "verbose": True}}
    )  # fmt: skip
    assert block.dynamic_batching.max_tokens == 4096
    with pytest.raises(ConfigError, match="lr_scaling_method"):
        DataSamplingConfig.from_dict({"dynamic_batching": {"lr_scaling_method": "cubic"}})
    with pytest.raises(ConfigError, match=r"dynamic_batching.enabled.*DynamicBatchSampler"):
        DataSamplingConfig.from_dict({"dynamic_batching": {"enabled": True, "max_tokens": 8}})
