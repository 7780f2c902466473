"""Per-op, per-size statistics of collectives: count, bytes, latency, algbw and busbw."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist

from slipstream.comm import _device

if TYPE_CHECKING:
    from slipstream.comm.config import CommsLoggerConfig

__all__ = ["CommsLogger", "CommsStats", "bus_bandwidth_factor", "comms_logger"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def bus_bandwidth_factor(op: str, group_size: int) -> float:
    """busbw / algbw for `op` over `group_size` ranks (NVIDIA nccl-tests' PERFORMANCE.md).

    all_reduce moves each byte 2(n-1)/n times over the busiest link; all_gather,
    reduce_scatter and all_to_all (n-1)/n; broadcast, send and recv once; barrier moves no
    data. Sizes follow nccl-tests too: all_gather and reduce_scatter count the whole (n-rank)
    buffer, not one rank's shard.
    """
    n = group_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in {"all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}:
        return (n - 1) / n
    if op in {"broadcast", "send", "recv"}:
        return 1.0
    if op == "barrier":
        return 0.0
    raise ValueError(f"no bus bandwidth formula for op {op!r}")


@dataclasses.dataclass
class CommsStats:
    """Accumulated statistics of one (op name, message size) pair.

    `bus_bytes` is the sum over calls of bytes × :func:`bus_bandwidth_factor`, so that busbw
    stays right when one op runs over groups of different sizes.
    """

    count: int = 0
    total_bytes: int = 0
    bus_bytes: float = 0.0
    total_latency_s: float = 0.0
    min_latency_s: float = float("inf")
    max_latency_s: float = 0.0
    async_count: int = 0

    @property
    def avg_latency_s(self) -> float:
        """Mean latency per call in seconds."""
        return self.total_latency_s / self.count if self.count else 0.0

    @property
    def algbw(self) -> float:
        """Algorithmic bandwidth, bytes/s: total bytes / total latency."""
        return self.total_bytes / self.total_latency_s if self.total_latency_s > 0 else 0.0

    @property
    def busbw(self) -> float:
        """Bus bandwidth, bytes/s: algbw corrected by the op's nccl-tests factor."""
        return self.bus_bytes / self.total_latency_s if self.total_latency_s > 0 else 0.0


def _format_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class CommsLogger:
    """Records collectives issued through :mod:`slipstream.comm`'s wrappers.

    Use the module singleton :data:`comms_logger`. While `enabled` is False the wrappers skip
    this class entirely (one boolean check). While it is on, each recorded op synchronises the
    accelerator before and after it, so that the latency covers the op alone; that costs
    overlap, so leave logging off in production runs.

    >>> from slipstream.comm import comms_logger
    >>> comms_logger.configure(enabled=True, prof_all=True)
    >>> # ... run collectives through slipstream.comm.all_reduce etc. ...
    >>> table = comms_logger.log_summary()
    """

    def __init__(self) -> None:
        """A disabled logger with DeepSpeed's defaults (prof_all on, verbose and debug off)."""
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.debug = False
        self.prof_ops: set[str] = set()
        self._records: dict[str, dict[int, CommsStats]] = {}

    def configure(
        self,
        config: CommsLoggerConfig | Mapping[str, Any] | None = None,
        *,
        enabled: bool | None = None,
        verbose: bool | None = None,
        prof_all: bool | None = None,
        debug: bool | None = None,
        prof_ops: Iterable[str] | None = None,
    ) -> None:
        """Apply a ``comms_logger`` block (a :class:`CommsLoggerConfig` or its dict) and/or keywords.

        Keywords left as None keep the value from `config`, or the current one without it.
        """
        if isinstance(config, Mapping):
            from slipstream.comm.config import CommsLoggerConfig

            config = CommsLoggerConfig.from_dict(config, "comms_logger")
        if config is not None:
            self.enabled = bool(config.enabled)
            self.verbose = bool(config.verbose)
            self.prof_all = bool(config.prof_all)
            self.debug = bool(config.debug)
            self.prof_ops = set(config.prof_ops)
        if enabled is not None:
            self.enabled = enabled
        if verbose is not None:
            self.verbose = verbose
        if prof_all is not None:
            self.prof_all = prof_all
        if debug is not None:
            self.debug = debug
        if prof_ops is not None:
            if isinstance(prof_ops, str):
                raise TypeError(f"prof_ops must be a list of op names, not the string {prof_ops!r}")
            self.prof_ops = set(prof_ops)

    def reset(self) -> None:
        """Forget every record (e.g. between epochs)."""
        self._records.clear()

    @property
    def records(self) -> dict[str, dict[int, CommsStats]]:
        """A copy of the records: ``{record name: {message bytes: CommsStats}}``."""
        return {
            name: {size: dataclasses.replace(stats) for size, stats in sizes.items()}
            for name, sizes in self._records.items()
        }

    def _should_record(self, op: str, log_name: str | None, prof: bool) -> bool:
        return self.prof_all or prof or op in self.prof_ops or log_name in self.prof_ops

    def run_logged(
        self,
        op: str,
        call: Callable[[], _T],
        *,
        num_bytes: int,
        group: Any = None,
        async_op: bool = False,
        prof: bool = False,
        log_name: str | None = None,
    ) -> _T:
        """Run `call` (the torch collective), timing and recording it if it is profiled.

        Called by the wrappers only while `enabled` is True. `num_bytes` is the op's message
        size in nccl-tests' convention; async ops are timed at issue only.
        """
        if not self._should_record(op, log_name, prof):
            return call()
        name = log_name or op
        if self.debug:
            # Frame 0 is this method, 1 the wrapper (all_reduce, ...), 2 its caller.
            name = f"{name} | [caller: {sys._getframe(2).f_code.co_name}]"
        # Costly: the device syncs below stall the stream so that the timing covers this op
        # only. They run only while logging is on.
        _device.synchronize()
        start = time.perf_counter()
        result = call()
        if not async_op:
            _device.synchronize()
        elapsed = time.perf_counter() - start
        group_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.record(name, op, num_bytes, elapsed, group_size, async_op=async_op)
        return result

    def record(
        self,
        name: str,
        op: str,
        num_bytes: int,
        latency_s: float,
        group_size: int,
        *,
        async_op: bool = False,
    ) -> None:
        """Add one call of `op` (recorded under `name`) that moved `num_bytes` in `latency_s`."""
        stats = self._records.setdefault(name, {}).setdefault(num_bytes, CommsStats())
        stats.count += 1
        stats.total_bytes += num_bytes
        stats.bus_bytes += num_bytes * bus_bandwidth_factor(op, group_size)
        stats.total_latency_s += latency_s
        stats.min_latency_s = min(stats.min_latency_s, latency_s)
        stats.max_latency_s = max(stats.max_latency_s, latency_s)
        stats.async_count += int(async_op)
        if self.verbose and _rank() == 0:
            algbw = num_bytes / latency_s if latency_s > 0 else 0.0
            busbw = algbw * bus_bandwidth_factor(op, group_size)
            logger.info(
                "comm op %s | size %s | latency %.3f ms | algbw %.3f GB/s | busbw %.3f GB/s%s",
                name,
                _format_size(num_bytes),
                latency_s * 1e3,
                algbw / 1e9,
                busbw / 1e9,
                " (async: timed at issue)" if async_op else "",
            )

    def format_summary(self) -> str:
        """The summary table as text (this rank's records)."""
        header = (
            f"{'op':<32} {'size':>12} {'count':>8} {'total lat (ms)':>15} "
            f"{'avg lat (ms)':>13} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"
        )
        lines = [header, "-" * len(header)]
        any_async = False
        for name in sorted(self._records):
            for size in sorted(self._records[name]):
                stats = self._records[name][size]
                mark = "*" if stats.async_count else ""
                any_async = any_async or bool(stats.async_count)
                lines.append(
                    f"{name + mark:<32} {_format_size(size):>12} {stats.count:>8} "
                    f"{stats.total_latency_s * 1e3:>15.3f} {stats.avg_latency_s * 1e3:>13.3f} "
                    f"{stats.algbw / 1e9:>13.3f} {stats.busbw / 1e9:>13.3f}"
                )
        if not self._records:
            lines.append("(no communication recorded)")
        lines.append(
            "sizes and busbw follow nccl-tests: all_gather/reduce_scatter count the full "
            "buffer; GB/s = 1e9 bytes/s"
        )
        if any_async:
            lines.append(
                "* includes async_op=True calls, timed at issue only: their latency excludes "
                "the transfer, so their bandwidth is overstated"
            )
        return "\n".join(lines)

    def log_summary(self) -> str:
        """Log the summary table on rank 0 and return it (on every rank)."""
        table = self.format_summary()
        if _rank() == 0:
            logger.info("communication summary (rank 0)\n%s", table)
        return table


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


comms_logger = CommsLogger()
"""The process-wide logger that :mod:`slipstream.comm`'s collectives report to."""
