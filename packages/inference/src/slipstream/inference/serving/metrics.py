"""Serving metrics in the Prometheus text format: counters, gauges and latency histograms."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Cumulative-bucket histogram of seconds, as Prometheus exposes one."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        """The ``_bucket``/``_sum``/``_count`` lines."""
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{label}"}} {running}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return lines


class ServingMetrics:
    """What a deployment records: token and request counts, latencies (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()
        self.request_latency = Histogram()
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # prompt tokens found in the prefix cache
        self.generation_tokens = 0
        self.requests = {"stop": 0, "length": 0, "abort": 0}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of the last window

    def record_tokens(self, count: int, now: float, window: float = 10.0) -> None:
        """Count generated tokens for the tokens/s gauge (caller holds ``lock``)."""
        self.generation_tokens += count
        self._recent.append((now, count))
        while self._recent and self._recent[0][0] < now - window:
            self._recent.popleft()

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last ``window`` seconds."""
        with self.lock:
            cutoff = time.monotonic() - window
            return sum(n for t, n in self._recent if t >= cutoff) / window

    def render(self, gauges: dict[str, tuple[float, str]], prefix: str = "slipstream") -> str:
        """All metrics, with ``gauges`` (name -> (value, help)) read at scrape time."""
        with self.lock:
            lines = []
            for name, (value, help_text) in gauges.items():
                lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} gauge"]
                lines.append(f"{prefix}_{name} {value}")
            for name, value, help_text in (
                ("prompt_tokens_total", self.prompt_tokens, "prompt tokens of started requests"),
                (
                    "prefix_cache_hit_tokens_total",
                    self.cached_prompt_tokens,
                    "prompt tokens reused from the prefix cache",
                ),
                ("generation_tokens_total", self.generation_tokens, "tokens generated"),
            ):
                lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} counter"]
                lines.append(f"{prefix}_{name} {value}")
            name = f"{prefix}_requests_finished_total"
            lines += [f"# HELP {name} finished requests by reason", f"# TYPE {name} counter"]
            lines += [f'{name}{{reason="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            lines += self.time_to_first_token.render(
                f"{prefix}_time_to_first_token_seconds", "arrival to first token"
            )
            lines += self.inter_token_latency.render(
                f"{prefix}_inter_token_latency_seconds", "time between consecutive tokens"
            )
            lines += self.request_latency.render(
                f"{prefix}_request_latency_seconds", "arrival to last token"
            )
        return "\n".join(lines) + "\n"
