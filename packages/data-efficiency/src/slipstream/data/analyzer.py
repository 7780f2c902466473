"""DataAnalyzer: difficulty metrics over a dataset, map-reduced across processes, to index files.

Map: each worker (a process; with ``run_map_reduce`` the ranks of a process group) computes
every metric over its contiguous shard of the dataset, chunk by chunk; each finished chunk is
saved atomically, so a restarted map skips the chunks it already has. Reduce: one process
merges the chunks into DeepSpeed's files, under ``save_path/<metric>/``:

* ``<metric>_sample_to_metric``: one row, the metric value of every sample.
* ``<metric>_index_to_sample``: one row per distinct value (ascending), its samples.
* ``<metric>_index_to_metric``: one row per distinct value, holding the value.
* ``<metric>_index_to_sample_percentile_merged``: the samples in metric order, 100 rows of
  about one percentile each.
* ``<metric>_metric_value`` (``accumulate_value_over_samples`` metrics): the summed array.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from slipstream.data.indexed import IndexedRowsWriter, fit_int_dtype, write_rows

__all__ = ["DataAnalyzer", "MetricType"]

logger = logging.getLogger(__name__)

MetricType = Literal["single_value_per_sample", "accumulate_value_over_samples"]


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


class _Progress:
    """A progress line every ~10% (and at the end), through logging."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.start = time.monotonic()
        self.next_report = 0.1

    def advance(self, count: int) -> None:
        self.done += count
        fraction = self.done / self.total
        if fraction >= self.next_report or self.done >= self.total:
            elapsed = time.monotonic() - self.start
            rate = self.done / elapsed if elapsed > 0 else float("inf")
            logger.info(
                "%s: %d/%d samples (%.0f%%, %.0f samples/s)",
                self.label,
                self.done,
                self.total,
                100 * fraction,
                rate,
            )
            self.next_report = (int(fraction * 10) + 1) / 10


class DataAnalyzer:
    """Computes difficulty metrics of ``dataset`` and writes the index files the sampler reads.

    Args:
        dataset: a map-style dataset.
        metric_names: one name per metric (the sub-directory and file prefix).
        metric_functions: ``batch -> values``: per-sample values (a length-``batch`` array)
            for ``single_value_per_sample``, an array to sum for ``accumulate_value_over_samples``.
        metric_types: one MetricType per metric.
        save_path: output directory.
        num_workers, worker_id: this process's shard (``run_map_reduce`` sets them from a
            process group).
        batch_size: samples per metric call.
        collate_fn: the DataLoader's collate function.
        chunk_size: samples per saved map chunk (the unit of resumption).

    >>> analyzer = DataAnalyzer(dataset, metric_names=["seqlen"],
    ...     metric_functions=[lambda batch: (batch != 0).sum(dim=1)],
    ...     metric_types=["single_value_per_sample"], save_path="analysis")  # doctest: +SKIP
    >>> analyzer.run_map_reduce()                                              # doctest: +SKIP
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        metric_names: Sequence[str],
        metric_functions: Sequence[Callable[[Any], Any]],
        metric_types: Sequence[MetricType],
        save_path: str | os.PathLike[str],
        num_workers: int = 1,
        worker_id: int = 0,
        batch_size: int = 64,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        chunk_size: int = 65536,
    ) -> None:
        if not (len(metric_names) == len(metric_functions) == len(metric_types)):
            raise ValueError(
                "DataAnalyzer: metric_names, metric_functions and metric_types need one entry "
                f"per metric (got {len(metric_names)}, {len(metric_functions)}, "
                f"{len(metric_types)})"
            )
        for kind in metric_types:
            if kind not in ("single_value_per_sample", "accumulate_value_over_samples"):
                raise ValueError(
                    f"DataAnalyzer: metric type {kind!r} is not valid; use "
                    "'single_value_per_sample' or 'accumulate_value_over_samples'"
                )
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id {worker_id} not in [0, {num_workers})")
        self.dataset = dataset
        self.metric_names = list(metric_names)
        self.metric_functions = list(metric_functions)
        self.metric_types = list(metric_types)
        self.save_path = Path(save_path)
        self.num_workers = num_workers
        self.worker_id = worker_id
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.chunk_size = max(chunk_size, batch_size)

    # ------------------------------------------------------------------ map
    def _shard(self, worker: int) -> tuple[int, int]:
        total = len(self.dataset)  # type: ignore[arg-type]
        return worker * total // self.num_workers, (worker + 1) * total // self.num_workers

    def _chunk_path(self, metric: str, worker: int, chunk: int) -> Path:
        return self.save_path / metric / f"map_worker{worker}" / f"chunk{chunk:06d}.npy"

    def run_map(self) -> None:
        """Compute this worker's shard; chunks already on disk are skipped (resumable)."""
        start, end = self._shard(self.worker_id)
        chunks = list(range(start, end, self.chunk_size))
        progress = _Progress(f"DataAnalyzer map (worker {self.worker_id})", end - start)
        for number, chunk_start in enumerate(chunks):
            chunk_end = min(chunk_start + self.chunk_size, end)
            paths = [self._chunk_path(m, self.worker_id, number) for m in self.metric_names]
            if all(path.is_file() for path in paths):
                progress.advance(chunk_end - chunk_start)
                continue
            results = self._map_chunk(chunk_start, chunk_end)
            for path, result in zip(paths, results):
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp.npy")
                np.save(tmp, result)
                os.replace(tmp, path)
            progress.advance(chunk_end - chunk_start)

    def _map_chunk(self, start: int, end: int) -> list[np.ndarray]:
        loader = DataLoader(
            Subset(self.dataset, range(start, end)),
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self.collate_fn,
        )
        per_sample: list[list[np.ndarray]] = [[] for _ in self.metric_names]
        summed: list[np.ndarray | None] = [None for _ in self.metric_names]
        for batch in loader:
            for index, (function, kind) in enumerate(zip(self.metric_functions, self.metric_types)):
                values = _as_numpy(function(batch))
                if kind == "single_value_per_sample":
                    per_sample[index].append(values.reshape(-1))
                else:
                    current = summed[index]
                    summed[index] = values.copy() if current is None else current + values
        out: list[np.ndarray] = []
        for index, kind in enumerate(self.metric_types):
            if kind == "single_value_per_sample":
                values = np.concatenate(per_sample[index]) if per_sample[index] else np.zeros(0)
                if values.shape[0] != end - start:
                    raise ValueError(
                        f"DataAnalyzer: metric {self.metric_names[index]!r} returned "
                        f"{values.shape[0]} values for {end - start} samples; a "
                        "single_value_per_sample metric returns one value per sample"
                    )
                out.append(values)
            else:
                value = summed[index]
                out.append(value if value is not None else np.zeros(0))
        return out

    # ------------------------------------------------------------------ reduce
    def _gather(self, metric: str) -> list[np.ndarray]:
        parts = []
        for worker in range(self.num_workers):
            start, end = self._shard(worker)
            count = len(range(start, end, self.chunk_size))
            for chunk in range(count):
                path = self._chunk_path(metric, worker, chunk)
                if not path.is_file():
                    raise FileNotFoundError(
                        f"DataAnalyzer reduce: {path} is missing; run the map of worker "
                        f"{worker} first (run_map with worker_id={worker})"
                    )
                parts.append(np.load(path))
        return parts

    def run_reduce(self) -> None:
        """Merge every worker's chunks into the index files (run by one process)."""
        for metric, kind in zip(self.metric_names, self.metric_types):
            directory = self.save_path / metric
            parts = self._gather(metric)
            if kind == "accumulate_value_over_samples":
                total = parts[0].copy()
                for part in parts[1:]:
                    total = total + part
                dtype = (
                    fit_int_dtype(int(total.min()), int(total.max())) if total.size else np.int64
                )
                write_rows(directory / f"{metric}_metric_value", [total], dtype)
                continue
            values = np.concatenate(parts)
            if values.size and not np.all(np.equal(np.mod(values, 1), 0)):
                raise ValueError(
                    f"DataAnalyzer: metric {metric!r} has non-integer values; the index files "
                    "hold integers (scale and round the metric, e.g. int(1000 * value))"
                )
            values = values.astype(np.int64)
            self._write_metric_index(directory, metric, values)
            logger.info("DataAnalyzer: wrote %s index files under %s", metric, directory)

    @staticmethod
    def _write_metric_index(directory: Path, metric: str, values: np.ndarray) -> None:
        count = values.shape[0]
        sample_dtype = fit_int_dtype(0, max(count - 1, 0))
        value_dtype = fit_int_dtype(int(values.min()), int(values.max())) if count else np.int64
        write_rows(directory / f"{metric}_sample_to_metric", [values], value_dtype)
        order = np.argsort(values, kind="stable")  # ascending value, then sample index
        sorted_values = values[order]
        unique, starts = np.unique(sorted_values, return_index=True)
        bounds = [*starts.tolist(), count]
        to_sample = IndexedRowsWriter(directory / f"{metric}_index_to_sample", sample_dtype)
        to_metric = IndexedRowsWriter(directory / f"{metric}_index_to_metric", value_dtype)
        for row, value in enumerate(unique):
            to_sample.add_row(order[bounds[row] : bounds[row + 1]])
            to_metric.add_row([value])
        to_sample.close()
        to_metric.close()
        percentiles = np.array_split(order, 100) if count else []
        write_rows(
            directory / f"{metric}_index_to_sample_percentile_merged", percentiles, sample_dtype
        )

    def run_map_reduce(self, group: Any = None) -> None:
        """Map on every rank of ``group`` (worker = rank), then reduce on its rank 0."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.num_workers = dist.get_world_size(group)
            self.worker_id = dist.get_rank(group)
            self.run_map()
            dist.barrier(group=group)
            if self.worker_id == 0:
                self.run_reduce()
            dist.barrier(group=group)
        else:
            self.run_map()
            self.run_reduce()
