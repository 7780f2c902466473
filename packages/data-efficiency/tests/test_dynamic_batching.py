"""Dynamic batching: packing within max_tokens, one pass per epoch over 2 ranks, resume, LR scaling."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from slipstream.data import (
    DataAnalyzer,
    DynamicBatchSampler,
    batch_by_seqlens,
    dataset_seqlens,
    sample_length,
    scale_lr,
)
from slipstream.data.config import DataEfficiencyConfig, DataSamplingConfig
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


def test_config_keys_are_typed_and_bad_values_are_named() -> None:
    block = DataSamplingConfig.from_dict(
        {"dynamic_batching": {"enabled": True, "max_tokens": 4096, "lr_scaling_method": "sqrt",
                              "sequence_picking_order": "seqlen", "min_batch_size": 2,
                              "max_batch_size": 16, "verbose": True}}
    )  # fmt: skip
    assert block.dynamic_batching.max_tokens == 4096
    with pytest.raises(ConfigError, match="lr_scaling_method"):
        DataSamplingConfig.from_dict({"dynamic_batching": {"lr_scaling_method": "cubic"}})
    with pytest.raises(ConfigError, match=r"dynamic_batching.max_tokens"):
        DataSamplingConfig.from_dict({"dynamic_batching": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"max_batch_size"):
        DataSamplingConfig.from_dict(
            {"dynamic_batching": {"enabled": True, "max_tokens": 8, "min_batch_size": 4,
                                  "max_batch_size": 2}}
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"dynamic_batching.enabled and .*curriculum_learning"):
        DataEfficiencyConfig.from_dict(
            {"enabled": True, "data_sampling": {
                "enabled": True, "dynamic_batching": {"enabled": True, "max_tokens": 8},
                "curriculum_learning": {"enabled": True, "curriculum_metrics": {"seqlen": {
                    "index_to_sample_path": "a", "index_to_metric_path": "b",
                    "difficulty_type": "value", "clustering_type": "schedule_based",
                    "min_difficulty": 1, "max_difficulty": 2, "schedule_type": "fixed_linear",
                    "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 1}}}}}}
        )  # fmt: skip
    # Every enclosing 'enabled' must be on (as for the other features).
    off = DataEfficiencyConfig.from_dict(
        {"enabled": True, "data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 8}}}
    )
    assert not off.dynamic_batching_enabled


def test_locate_and_seek_follow_the_epochs_of_a_random_order() -> None:
    sampler = _samplers()[0]
    per_epoch = [len(sampler.global_batches(e)) for e in range(3)]
    index = per_epoch[0] + per_epoch[1] + 2
    assert sampler.locate(index) == (2, 2)
    assert sampler.global_batch_size(index) == sampler.batch_sizes(2)[2]
    sampler.seek(index)
    assert sampler.state_dict() == {"epoch": 2, "position": 2}
    assert next(iter(sampler)) == sampler.global_batches(2)[2][0]


def test_sequence_lengths_from_samples_and_from_the_analyzer(tmp_path: Path) -> None:
    assert sample_length(torch.zeros(3, 7)) == 7
    assert sample_length({"input_ids": [1, 2, 3], "labels": [0]}) == 3
    assert sample_length((torch.zeros(5), torch.zeros(5))) == 5
    assert sample_length([4, 5]) == 2
    with pytest.raises(TypeError, match="metrics_path"):
        sample_length(3.0)
    samples = [torch.arange(n % 5 + 1) for n in range(12)]
    measured = dataset_seqlens(samples)
    assert measured == [n % 5 + 1 for n in range(12)]
    DataAnalyzer(
        samples,
        metric_names=["seqlen"],
        metric_functions=[lambda batch: torch.tensor([len(s) for s in batch])],
        metric_types=["single_value_per_sample"],
        save_path=tmp_path,
        batch_size=4,
        collate_fn=list,
    ).run_map_reduce()
    assert dataset_seqlens(samples, str(tmp_path)) == measured
    with pytest.raises(ValueError, match="another dataset"):
        dataset_seqlens(samples[:5], str(tmp_path))
