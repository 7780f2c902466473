"""CurriculumSampler (difficulty range, coverage over ranks, resume) and DataAnalyzer's files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from slipstream.data import (
    CurriculumSampler,
    DataAnalyzer,
    DataEfficiencyConfig,
    IndexedRows,
    MetricIndex,
    write_rows,
)

N = 96


def _config(
    difficulty_type: str = "value",
    low: int = 4,
    high: int = 16,
    total_step: int = 6,
    paths: tuple[str, str] | None = None,
    epochs: int = 10,
) -> DataEfficiencyConfig:
    metric: dict[str, Any] = {
        "difficulty_type": difficulty_type,
        "min_difficulty": low,
        "max_difficulty": high,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": total_step, "difficulty_step": 4},
        "index_to_sample_path": paths[0] if paths else "unused",
        "index_to_metric_path": paths[1] if paths else "unused",
    }
    return DataEfficiencyConfig.from_dict(
        {"enabled": True, "seed": 7,
         "data_sampling": {"enabled": True, "num_epochs": epochs,
                           "curriculum_learning": {"enabled": True,
                                                   "curriculum_metrics": {"len": metric}}}}
    )  # fmt: skip


VALUES = np.array([(i * 7) % 16 + 1 for i in range(N)])  # 1..16, six samples each


def _samplers(config: DataEfficiencyConfig, world: int, micro: int, gas: int) -> list:
    return [
        CurriculumSampler(
            config,
            N,
            micro_batch_size=micro,
            data_parallel_rank=rank,
            data_parallel_size=world,
            gradient_accumulation_steps=gas,
            metrics={"len": MetricIndex.from_values(VALUES)},
        )
        for rank in range(world)
    ]


def _global_steps(samplers: list, steps: int, gas: int, epochs: list | None = None) -> list:
    """Each step's global batch, assembled from every rank's micro-batches."""
    iterators = [iter(s) for s in samplers]
    batches = []
    for _ in range(steps):
        batch: list[int] = []
        for _ in range(gas):
            for it in iterators:
                batch += next(it)
        batches.append(batch)
        if epochs is not None:
            epochs.append(samplers[0].epoch)
    return batches


@pytest.mark.parametrize(("world", "micro", "gas"), [(2, 3, 2), (4, 2, 1)])
def test_batches_stay_in_range_and_cover_each_epoch_once(world: int, micro: int, gas: int) -> None:
    config = _config()
    samplers = _samplers(config, world, micro, gas)
    global_batch = world * micro * gas
    epochs: list[int] = []
    batches = _global_steps(samplers, 60, gas, epochs)
    reference = _samplers(config, 1, global_batch, 1)[0]  # same schedule, one rank
    by_epoch: dict[int, list[int]] = {}
    for step, (batch, epoch) in enumerate(zip(batches, epochs), start=1):
        assert len(batch) == global_batch
        difficulty = reference.schedulers["len"].update_difficulty(step)
        assert VALUES[batch].max() <= difficulty, (step, difficulty)
        by_epoch.setdefault(epoch, []).extend(batch)
    assert len(by_epoch) >= 3
    for epoch, samples in by_epoch.items():
        assert len(samples) == len(set(samples)), f"a sample repeated within epoch {epoch}"
    # Once at max difficulty (epochs after the first), an epoch covers the whole dataset but
    # for the remainder that does not fill a global batch.
    for epoch in sorted(by_epoch)[1:-1]:
        assert len(by_epoch[epoch]) == N - N % global_batch


def test_percentile_difficulty_takes_the_easiest_fraction() -> None:
    config = _config("percentile", low=25, high=100, total_step=1000)
    values = (np.arange(400) * 13) % 37
    sampler = CurriculumSampler(
        config, 400, micro_batch_size=8, data_parallel_rank=0, data_parallel_size=1,
        metrics={"len": MetricIndex.from_values(values)},
    )  # fmt: skip
    first = next(iter(sampler))
    assert sampler.get_current_difficulties() == {"len": 24}  # 25 rounded down to a step of 4
    # DeepSpeed's arithmetic: whole percentiles of N // 100 samples, in metric order.
    eligible = np.argsort(values, kind="stable")[: (400 // 100) * 24]
    assert set(first) <= set(eligible.tolist())


@pytest.mark.parametrize("world", [2, 4])
def test_resume_mid_epoch_draws_the_same_batches(world: int) -> None:
    config = _config()
    uninterrupted = _global_steps(_samplers(config, world, 2, 2), 30, 2)
    # Stop in the middle of a global batch: 13 steps and one micro-step of the 14th.
    fresh = _samplers(config, world, 2, 2)
    its = [iter(s) for s in fresh]
    for _ in range(13 * 2 + 1):  # 13 steps and one micro-step of the 14th
        for it in its:
            next(it)
    states = [s.state_dict() for s in fresh]
    restored = _samplers(config, world, 2, 2)
    for sampler, state in zip(restored, states):
        sampler.load_state_dict(state)
    its = [iter(s) for s in restored]
    step14_rest: list[int] = []
    for it in its:
        step14_rest += next(it)
    assert step14_rest == uninterrupted[13][world * 2 :]
    assert _global_steps(restored, 16, 2) == uninterrupted[14:30]


def test_range_too_small_for_a_batch_is_a_named_error() -> None:
    config = _config(low=1, high=16, total_step=10_000)  # difficulty stays 0 for many steps
    sampler = _samplers(config, 1, 4, 1)[0]
    with pytest.raises(ValueError, match="fewer than a global batch"):
        next(iter(sampler))


class _Tokens(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(1, 17, (N,), generator=generator)

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        row = torch.zeros(16, dtype=torch.long)
        row[: int(self.lengths[index])] = index % 50 + 1
        return row


def _seqlen(batch: torch.Tensor) -> torch.Tensor:
    return (batch != 0).sum(dim=1)


def _vocab_counts(batch: torch.Tensor) -> np.ndarray:
    return np.bincount(batch.reshape(-1).numpy(), minlength=64)


def test_analyzer_map_reduce_resume_and_sampler_from_files(tmp_path: Path) -> None:
    dataset = _Tokens()
    kwargs: dict[str, Any] = dict(
        metric_names=["seqlen", "vocab"],
        metric_functions=[_seqlen, _vocab_counts],
        metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
        save_path=tmp_path,
        num_workers=2,
        batch_size=5,
        chunk_size=10,
    )
    DataAnalyzer(dataset, worker_id=0, **kwargs).run_map()
    worker1 = DataAnalyzer(dataset, worker_id=1, **kwargs)
    worker1.run_map()
    # Resumable: a finished chunk is not recomputed (its file is kept as it is).
    chunk = tmp_path / "seqlen" / "map_worker1" / "chunk000000.npy"
    stamp = chunk.stat().st_mtime_ns
    worker1.run_map()
    assert chunk.stat().st_mtime_ns == stamp
    worker1.run_reduce()

    lengths = dataset.lengths.numpy()
    prefix = tmp_path / "seqlen" / "seqlen"
    assert np.array_equal(IndexedRows(f"{prefix}_sample_to_metric")[0], lengths)
    to_sample, to_metric = (
        IndexedRows(f"{prefix}_index_to_sample"),
        IndexedRows(f"{prefix}_index_to_metric"),
    )
    values = [int(to_metric[i][0]) for i in range(len(to_metric))]
    assert values == sorted(set(lengths.tolist()))
    for row, value in enumerate(values):
        assert to_sample[row].tolist() == np.flatnonzero(lengths == value).tolist()
    merged = IndexedRows(f"{prefix}_index_to_sample_percentile_merged").concatenated()
    assert merged.tolist() == np.argsort(lengths, kind="stable").tolist()
    vocab = IndexedRows(tmp_path / "vocab" / "vocab_metric_value")[0]
    expected = np.bincount(torch.stack([dataset[i] for i in range(N)]).reshape(-1), minlength=64)
    assert np.array_equal(vocab, expected)

    config = _config(paths=(f"{prefix}_index_to_sample", f"{prefix}_index_to_metric"))
    from_files = CurriculumSampler(
        config, N, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1
    )
    from_values = CurriculumSampler(
        config, N, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1,
        metrics={"len": MetricIndex.from_values(lengths)},
    )  # fmt: skip
    a, b = iter(from_files), iter(from_values)
    for _ in range(10):
        batch = next(a)
        assert batch == next(b)
        assert lengths[batch].max() <= from_files.get_current_difficulties()["len"]

    # Percentile-based, from the merged file: the easiest 4/8 of the samples in metric order.
    merged_prefix = f"{prefix}_index_to_sample_percentile_merged"
    percentile = _config("percentile", low=4, high=8, total_step=10_000, paths=(merged_prefix, ""))
    sampler = CurriculumSampler(
        percentile, N, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1
    )
    easiest = set(np.argsort(lengths, kind="stable")[: (N // 8) * 4].tolist())
    iterator = iter(sampler)
    drawn = [i for _ in range(12) for i in next(iterator)]
    assert set(drawn) == easiest  # 12 batches of 4 = all 48 eligible samples, once each


def test_index_files_round_trip_and_reject_other_files(tmp_path: Path) -> None:
    rows = [np.array([3, 1, 2]), np.array([], dtype=np.int64), np.array([70000])]
    write_rows(tmp_path / "x", rows, np.int64)
    read = IndexedRows(tmp_path / "x")
    assert [r.tolist() for r in (read[0], read[1], read[2])] == [[3, 1, 2], [], [70000]]
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="MMIDIDX"):
        IndexedRows(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="DataAnalyzer"):
        IndexedRows(tmp_path / "missing")


def _map_reduce_worker(save_path: str) -> list[int]:
    analyzer = DataAnalyzer(
        _Tokens(),
        metric_names=["seqlen"],
        metric_functions=[_seqlen],
        metric_types=["single_value_per_sample"],
        save_path=save_path,
        batch_size=8,
        chunk_size=16,
    )
    analyzer.run_map_reduce()  # worker = rank; rank 0 reduces after a barrier
    return IndexedRows(Path(save_path) / "seqlen" / "seqlen_sample_to_metric")[0].tolist()


def test_analyzer_map_reduce_over_processes(tmp_path: Path) -> None:
    from slipstream.comm.testing import run_distributed

    results = run_distributed(_map_reduce_worker, 2, str(tmp_path))
    expected = _Tokens().lengths.tolist()
    assert results == [expected, expected]
    assert sorted(p.name for p in (tmp_path / "seqlen").glob("map_worker*")) == [
        "map_worker0",
        "map_worker1",
    ]


def test_post_process_sees_the_difficulty_each_batch_was_drawn_at() -> None:
    from torch.utils.data import TensorDataset

    from slipstream.data import build_curriculum_dataloader

    sampler = _samplers(_config(), 1, 4, 1)[0]
    seen: list[tuple[int, int]] = []

    def post_process(batch: list, progress: dict) -> list:
        seen.append((progress["curriculum_step"], progress["current_difficulties"]["len"]))
        return [batch[0][:, : progress["current_difficulties"]["len"]]]

    dataset = TensorDataset(torch.arange(N * 16).view(N, 16), torch.as_tensor(VALUES))
    loader = build_curriculum_dataloader(dataset, sampler, post_process=post_process)
    iterator = iter(loader)
    reference = _samplers(_config(), 1, 4, 1)[0]
    for step in range(1, 8):
        (cut,) = next(iterator)
        difficulty = reference.schedulers["len"].update_difficulty(step)
        assert seen[-1] == (step, difficulty) and cut.shape == (4, difficulty)


def test_resume_on_another_world_size_starts_the_next_global_batch() -> None:
    config = _config()
    before = _samplers(config, 2, 2, 2)
    iterators = [iter(s) for s in before]
    for it in iterators:  # one micro-step of the first global batch
        next(it)
    state = before[0].state_dict()
    after = _samplers(config, 4, 2, 1)
    for sampler in after:
        sampler.load_state_dict(state)
    batch = [i for s in after for i in next(iter(s))]
    assert after[0].curriculum_step == 2 and len(batch) == 8
    assert not set(batch) & {i for s in before for i in s.batch}  # left-overs stay used
    assert not set(batch) & set(np.flatnonzero(before[0].used).tolist())
