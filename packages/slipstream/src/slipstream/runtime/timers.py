"""Named wall-clock timers for `wall_clock_breakdown` (forward, backward, allreduce, step)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class WallClockTimers:
    """Accumulates elapsed milliseconds per name between two reports.

    Device work is asynchronous, so each measured region is bracketed by ``synchronize`` —
    which stalls the host. That cost is why the timers run only when `wall_clock_breakdown`
    is enabled; otherwise ``region`` is a no-op.
    """

    def __init__(self, enabled: bool, synchronize: Callable[[], None]) -> None:
        self.enabled = enabled
        self._synchronize = synchronize
        self._elapsed_ms: dict[str, float] = {}

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time the enclosed block under ``name`` (no-op when disabled)."""
        if not self.enabled:
            yield
            return
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self._elapsed_ms[name] = (
                self._elapsed_ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3
            )

    def report(self) -> str:
        """`name: X ms` for every region since the last report, then reset."""
        text = " | ".join(f"{name}: {ms:.2f} ms" for name, ms in self._elapsed_ms.items())
        self._elapsed_ms.clear()
        return text
