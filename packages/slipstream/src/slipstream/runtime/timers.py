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
        self._step_ms: dict[str, float] = {}  # since the last take_step_ms (the monitors)

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
            elapsed = (time.perf_counter() - start) * 1e3
            self._elapsed_ms[name] = self._elapsed_ms.get(name, 0.0) + elapsed
            self._step_ms[name] = self._step_ms.get(name, 0.0) + elapsed

    def take_step_ms(self) -> dict[str, float]:
        """Milliseconds per name since the last call, then reset (empty when disabled)."""
        taken, self._step_ms = self._step_ms, {}
        return taken

    def report(self) -> str:
        """`name: X ms` for every region since the last report, then reset."""
        text = " | ".join(f"{name}: {ms:.2f} ms" for name, ms in self._elapsed_ms.items())
        self._elapsed_ms.clear()
        return text
