"""CurriculumSampler: global batches drawn from the current difficulty range, split over DP ranks.

[Note: deterministic sampling without a broadcast]
DeepSpeed's sampler draws each global batch on rank 0 and broadcasts it. Here every rank
computes the same global batch from the same state instead: an epoch's order is a permutation
seeded by ``(seed, epoch)``; each global batch is the next ``global_batch_size`` samples of that
order that are eligible (inside every metric's current difficulty range) and unused in this
epoch. Ranks then take their own slice of each micro-step's ``micro_batch * dp`` samples. No
communication, and the state (epoch, used-set, position in the global batch, curriculum step)
fully determines what comes next, so a resumed run draws exactly what an uninterrupted one
would. When fewer than a global batch of eligible unused samples remain, the epoch ends (the
remainder is dropped, as with ``drop_last``) and the next epoch starts with every sample unused.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from slipstream.data.config import CurriculumMetricConfig, DataEfficiencyConfig
from slipstream.data.curriculum import CurriculumScheduler
from slipstream.data.indexed import IndexedRows

__all__ = [
    "CurriculumDataLoader",
    "CurriculumSampler",
    "MetricIndex",
    "PostProcess",
    "build_curriculum_dataloader",
]

# DeepSpeed's data post-processing hook: ``fn(batch, sampler_progress) -> batch``.
PostProcess = Callable[[Any, dict[str, Any]], Any]

logger = logging.getLogger(__name__)


class MetricIndex:
    """One metric over a dataset: each sample's value and its position in metric order.

    Build it from the DataAnalyzer's files (:meth:`from_files`) or from per-sample values
    (:meth:`from_values`). Two integers per sample are held in memory (positions in int32 below
    2**31 samples); the index files themselves stay memory-mapped.
    """

    def __init__(self, values: np.ndarray | None, order: np.ndarray) -> None:
        count = int(order.shape[0])
        index_type = np.int32 if count < 2**31 else np.int64
        self.values = None if values is None else np.asarray(values)
        self.position = np.empty(count, dtype=index_type)
        self.position[np.asarray(order)] = np.arange(count, dtype=index_type)

    @classmethod
    def from_values(cls, values: np.ndarray | list[int]) -> MetricIndex:
        """From the metric value of every sample (ties keep sample order)."""
        array = np.asarray(values, dtype=np.int64)
        return cls(array, np.argsort(array, kind="stable"))

    @classmethod
    def from_files(cls, index_to_sample: str, index_to_metric: str | None) -> MetricIndex:
        """From ``<metric>_index_to_sample`` and (value-based) ``<metric>_index_to_metric``."""
        rows = IndexedRows(index_to_sample)
        order = np.asarray(rows.concatenated(), dtype=np.int64)
        if index_to_metric is None:  # percentile-based: the order is all that is needed
            return cls(None, order)
        metric_rows = IndexedRows(index_to_metric)
        if len(metric_rows) != len(rows):
            raise ValueError(
                f"{index_to_metric} has {len(metric_rows)} rows but {index_to_sample} has "
                f"{len(rows)}; they must come from the same DataAnalyzer run"
            )
        row_values = np.array([int(metric_rows[i][0]) for i in range(len(metric_rows))])
        values = np.zeros(order.shape[0], dtype=np.int64)
        values[order] = np.repeat(row_values, np.asarray(rows.sizes, dtype=np.int64))
        return cls(values, order)

    def __len__(self) -> int:
        return int(self.position.shape[0])


class CurriculumSampler(torch.utils.data.Sampler[list[int]]):
    """A batch sampler: yields this rank's micro-batch indices, global batches drawn from the
    current difficulty range of every metric (see the module's note).

    Args:
        config: the data_efficiency block (seed, num_epochs and the metric curricula).
        num_samples: samples in one epoch of the dataset.
        micro_batch_size, gradient_accumulation_steps: the engine's batch triple.
        data_parallel_rank, data_parallel_size: this rank and the DP world size.
        metrics: metric name -> MetricIndex, overriding the config's index files.

    >>> sampler = CurriculumSampler(config, len(dataset), micro_batch_size=4,
    ...     data_parallel_rank=rank, data_parallel_size=world,
    ...     gradient_accumulation_steps=1)                             # doctest: +SKIP
    """

    def __init__(
        self,
        config: DataEfficiencyConfig,
        num_samples: int,
        *,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        gradient_accumulation_steps: int = 1,
        metrics: Mapping[str, MetricIndex] | None = None,
    ) -> None:
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})"
            )
        if micro_batch_size <= 0 or num_samples <= 0:
            raise ValueError(
                f"micro_batch_size ({micro_batch_size}) and num_samples ({num_samples}) must be > 0"
            )
        curriculum = config.data_sampling.curriculum_learning
        self.seed = config.seed
        self.num_samples = num_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.world = data_parallel_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.global_batch_size = self.micro_times_dp * gradient_accumulation_steps
        self.total_samples = num_samples * config.data_sampling.num_epochs
        self.metric_configs: dict[str, CurriculumMetricConfig] = dict(curriculum.curriculum_metrics)
        self.schedulers = {
            name: CurriculumScheduler(metric.schedule_params())
            for name, metric in self.metric_configs.items()
        }
        self.metrics: dict[str, MetricIndex] = {}
        for name, metric in self.metric_configs.items():
            if metric.clustering_type == "single_cluster":
                continue
            if metrics is not None and name in metrics:
                self.metrics[name] = metrics[name]
            else:
                assert metric.index_to_sample_path is not None  # validated with the config
                self.metrics[name] = MetricIndex.from_files(
                    metric.index_to_sample_path,
                    metric.index_to_metric_path if metric.difficulty_type == "value" else None,
                )
            if len(self.metrics[name]) != num_samples:
                raise ValueError(
                    f"curriculum metric {name!r} covers {len(self.metrics[name])} samples but "
                    f"the dataset has {num_samples}; analyse this dataset with DataAnalyzer"
                )
        # Loop state (all of it in state_dict()).
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.epoch = 0
        self.current_difficulties: dict[str, int] = {}
        self.used = np.zeros(num_samples, dtype=bool)
        self.batch: list[int] = []
        # Derived from the state, rebuilt on demand.
        self._candidates: np.ndarray | None = None
        self._cursor = 0

    # ------------------------------------------------------------------ difficulty
    def set_custom_curriculum_learning_schedule(
        self, schedule_functions: Mapping[str, Callable[[int], int]]
    ) -> None:
        """Difficulty functions (``step -> difficulty``) of metrics with schedule_type custom."""
        for name, function in schedule_functions.items():
            if name in self.schedulers:
                self.schedulers[name].set_custom_get_difficulty(function)

    def get_current_difficulties(self) -> dict[str, int]:
        """The current difficulty of every metric."""
        return dict(self.current_difficulties)

    def eligible(self, difficulties: Mapping[str, int]) -> np.ndarray:
        """Mask of the samples inside every metric's difficulty range."""
        mask = np.ones(self.num_samples, dtype=bool)
        for name, index in self.metrics.items():
            metric = self.metric_configs[name]
            difficulty = difficulties[name]
            if metric.difficulty_type == "value":
                if index.values is None:
                    raise ValueError(
                        f"curriculum metric {name!r} is value-based but its index has no "
                        "values; give index_to_metric_path (or MetricIndex.from_values)"
                    )
                mask &= index.values <= difficulty
            else:
                # DeepSpeed's percentile arithmetic: whole percentiles of N // max samples,
                # the full dataset at max_difficulty.
                if difficulty >= metric.max_difficulty:
                    count = self.num_samples
                else:
                    count = (self.num_samples // metric.max_difficulty) * difficulty
                mask &= index.position < count
        return mask

    # ------------------------------------------------------------------ drawing
    def _epoch_order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)

    def _refresh_candidates(self) -> None:
        order = self._epoch_order()
        keep = self.eligible(self.current_difficulties)[order] & ~self.used[order]
        self._candidates = order[keep]
        self._cursor = 0

    def _take(self) -> np.ndarray | None:
        if self._candidates is None:
            self._refresh_candidates()
        assert self._candidates is not None
        if self._candidates.shape[0] - self._cursor < self.global_batch_size:
            return None
        chosen = self._candidates[self._cursor : self._cursor + self.global_batch_size]
        self._cursor += self.global_batch_size
        return chosen

    def _next_global_batch(self) -> None:
        self.curriculum_step += 1
        difficulties = {
            name: scheduler.update_difficulty(self.curriculum_step)
            for name, scheduler in self.schedulers.items()
        }
        if difficulties != self.current_difficulties:
            self.current_difficulties = difficulties
            self._candidates = None
        chosen = self._take()
        if chosen is None:
            self.epoch += 1
            self.used[:] = False
            self._candidates = None
            chosen = self._take()
            if chosen is None:
                size = int(self.eligible(self.current_difficulties).sum())
                raise ValueError(
                    f"the curriculum's difficulty range {self.current_difficulties} holds "
                    f"{size} samples, fewer than a global batch ({self.global_batch_size}); "
                    "raise min_difficulty or use a smaller batch"
                )
            logger.debug("curriculum sampler: epoch %d begins", self.epoch)
        self.used[chosen] = True
        self.batch = [int(i) for i in chosen]

    def __iter__(self) -> Iterator[list[int]]:
        while self.consumed_samples + self.micro_times_dp <= self.total_samples:
            if not self.batch:
                self._next_global_batch()
            micro = self.batch[: self.micro_times_dp]
            self.batch = self.batch[self.micro_times_dp :]
            self.consumed_samples += self.micro_times_dp
            start = self.rank * self.micro_batch_size
            yield micro[start : start + self.micro_batch_size]

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.micro_times_dp

    def progress(self) -> dict[str, Any]:
        """Where the sampler stands (DeepSpeed's state keys, without the bulky ones): the
        ``current_difficulties`` a post-processing hook truncates by, ``consumed_samples``,
        ``curriculum_step`` and ``epoch``."""
        return {
            "current_difficulties": dict(self.current_difficulties),
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "epoch": self.epoch,
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the next batches (JSON-ready; the used-set bit-packed)."""
        return {
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "epoch": self.epoch,
            "current_difficulties": dict(self.current_difficulties),
            "batch": list(self.batch),
            "used": base64.b64encode(np.packbits(self.used).tobytes()).decode("ascii"),
            "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "micro_batch_times_dp": self.micro_times_dp,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where state_dict() was taken."""
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"the sampler's checkpoint was taken over {state['num_samples']} samples; this "
                f"dataset has {self.num_samples}"
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.epoch = int(state["epoch"])
        self.current_difficulties = {k: int(v) for k, v in state["current_difficulties"].items()}
        self.batch = [int(i) for i in state["batch"]]
        saved_layout = (state.get("global_batch_size"), state.get("micro_batch_times_dp"))
        if saved_layout != (self.global_batch_size, self.micro_times_dp) and self.batch:
            # Another batch layout (a new world size): the rest of the global batch drawn under
            # the old one cannot be split evenly; its samples stay used and the next global
            # batch is drawn under the new layout.
            logger.warning(
                "curriculum sampler: resuming with global batch %d (micro x DP %d) instead of "
                "%s (%s); skipping the %d samples left of the interrupted global batch",
                self.global_batch_size,
                self.micro_times_dp,
                saved_layout[0],
                saved_layout[1],
                len(self.batch),
            )
            self.batch = []
        packed = np.frombuffer(base64.b64decode(state["used"]), dtype=np.uint8)
        self.used = np.unpackbits(packed)[: self.num_samples].astype(bool)
        for name, scheduler_state in state["schedulers"].items():
            self.schedulers[name].load_state_dict(scheduler_state)
        self._candidates = None


class CurriculumDataLoader(DataLoader):
    """A DataLoader over a CurriculumSampler that can post-process each batch.

    ``post_process(batch, sampler.progress())`` (DeepSpeed's ``set_data_post_process_func``)
    sees the difficulties the batch was drawn at, e.g. to cut it to a seqlen metric's
    difficulty for a ``single_cluster`` curriculum.
    """

    post_process: PostProcess | None = None

    def __iter__(self) -> Any:
        # The base iterator is created here, eagerly: it draws its seed from the global RNG.
        return self._post_processed(super().__iter__())

    def _post_processed(self, iterator: Iterator[Any]) -> Iterator[Any]:
        sampler = self.batch_sampler
        assert isinstance(sampler, CurriculumSampler)
        for batch in iterator:
            # Read per batch: the hook may be set after the iterator was made.
            post_process = self.post_process
            yield batch if post_process is None else post_process(batch, sampler.progress())


def build_curriculum_dataloader(
    dataset: Dataset,
    sampler: CurriculumSampler,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    post_process: PostProcess | None = None,
) -> CurriculumDataLoader:
    """A DataLoader whose batches come from ``sampler`` (one micro-batch per iteration)."""
    loader = CurriculumDataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    loader.post_process = post_process
    return loader
