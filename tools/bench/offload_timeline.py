"""Where a CPU-offloaded step's time goes: host timestamps of one step, per rank.

``train_bench.py --timeline PATH`` installs this on the engine (ZeRO 1-2 with
``offload_optimizer.device: cpu``): it wraps the engine's ``forward``/``backward``/``step``, the
CPU worker's jobs (each landed bucket's wait for its device-to-host copy, hand-over and step),
each bucket's launch (reduce-scatter + copy to the host) and each publish (upload + all-gather
of a stepped bucket) with ``time.perf_counter`` stamps. Only the host side is seen: a stamp
says when the host issued or finished waiting for something, not when the GPU ran it.

The summary's ``worker`` block splits the worker's calls (``jobs_detail``: start, end, the wait for
the bucket's copy to the host, the C++ kernel from the step's own clock, the rest) and its idle
time, with the queue empty (waiting for the next bucket to be launched) or not.

It is a benchmark instrument, not a library feature: it patches private methods of
``slipstream.zero`` for the process it runs in, and costs a few microseconds per event.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Timeline"]


class Timeline:
    """Records ``(name, start, end)`` spans of the step being timed (see :meth:`begin_step`),
    and the host period of each step before it."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.spans: list[tuple[str, float, float, str]] = []
        self.periods: list[float] = []  # host seconds from one begin_step() to the next
        self._lock = threading.Lock()
        self._restore: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ recording
    def begin_step(self) -> None:
        """Forget what was recorded; times count from now."""
        with self._lock:
            now = time.perf_counter()
            if self.spans:
                self.periods.append(now - self.origin)
            self.spans.clear()
            self.origin = now

    def _add(self, name: str, start: float, end: float) -> None:
        thread = threading.current_thread().name
        with self._lock:
            self.spans.append((name, start - self.origin, end - self.origin, thread))

    def _wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(name, start, time.perf_counter())

        self._restore.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, timed)

    def install(self, engine: Any) -> None:
        """Wrap the engine's phases and the offload path's internals (class-wide)."""
        import torch

        from slipstream.zero import grad_reduce, offload, stage12

        for attr in ("forward", "backward", "step"):
            self._wrap(engine, attr, attr)
        self._wrap(grad_reduce.GradientReduceScatter, "_launch", "launch")
        self._wrap(grad_reduce.GradientReduceScatter, "finish", "finish")
        self._wrap(grad_reduce.GradientReduceScatter, "_hand_over_slices", "hand_over")
        self._wrap(offload.OffloadedStep, "settle_speculation", "settle")
        # overlap_forward: a forward's wait for a bucket still stepping, and its publish.
        self._wrap(offload.OffloadedStep, "publish_next", "forward_publish")
        # The reducer holds these as bound methods taken at set-up: wrap its attributes.
        zero = engine.zero
        if not isinstance(zero, stage12.ShardedOptimizerStates):
            raise SystemExit("--timeline: needs ZeRO stage 1 or 2 with CPU optimizer offload")
        for attr, name in (("step_indices", "cpu_step"), ("on_bucket_stepped", "publish")):
            if getattr(zero.reducer, attr, None) is not None:
                self._wrap(zero.reducer, attr, name)
        self._wrap(torch.cuda.Event, "synchronize", "event_wait")
        self._wrap(offload.OffloadedStep, "_stage", "stage")  # overlap_forward's early upload
        if getattr(zero.reducer, "before_stepped", None) is not None:
            self._wrap(zero.reducer, "before_stepped", "check")  # the early norm check (main)
        self._wrap_kernel()
        original_submit: Callable[..., Any] = offload.StepWorker.submit
        original_execute: Callable[..., Any] = offload.StepWorker._execute
        timeline = self
        queued_at: dict[int, float] = {}

        def submit(worker: Any, run: Callable[[], None], *args: Any, **kwargs: Any) -> Any:
            queued = time.perf_counter()
            future = original_submit(worker, run, *args, **kwargs)
            queued_at[id(future)] = queued
            return future

        def execute(batch: list[Any]) -> None:
            # One worker call: a job, or several merged ones (merge_bucket_size).
            start = time.perf_counter()
            worker = timeline._worker
            for job in batch:
                queued = queued_at.pop(id(job[1]), None)
                if queued is not None:
                    timeline._add("queued", queued, start)
            ready = batch[0][2]
            if ready is not None and not ready():
                timeline._add("not_ready", start, start)
            if len(batch) > 1:
                timeline._add(f"merged{len(batch)}", start, start)
            try:
                original_execute(batch)
            finally:
                end = time.perf_counter()
                timeline._add("job", start, end)
                if worker is not None and not worker._jobs:  # nothing queued behind it
                    timeline._add("queue_empty", end, end)

        self._restore.append((offload.StepWorker, "submit", original_submit))
        self._restore.append(
            (offload.StepWorker, "_execute", offload.StepWorker.__dict__["_execute"])
        )
        offload.StepWorker.submit = submit  # type: ignore[method-assign]
        offload.StepWorker._execute = staticmethod(execute)  # type: ignore[method-assign,assignment]
        self._offload = zero.optimizer.offload

    @property
    def _worker(self) -> Any:
        offload = getattr(self, "_offload", None)
        return getattr(offload, "_pool", None)

    def _wrap_kernel(self) -> None:
        """Each C++ Adam call ("cpp": the Python call, GIL taken back included) and the OpenMP
        region inside it ("kernel", from the step's own clock, ending when the call returns)."""
        from slipstream.offload.host_optimizer import HostOptimizer

        original = HostOptimizer._cpp_adam
        timeline = self

        def timed(host: Any, *args: Any, **kwargs: Any) -> Any:
            before = host._kernel[0]
            start = time.perf_counter()
            try:
                return original(host, *args, **kwargs)
            finally:
                end = time.perf_counter()
                wall = host._kernel[0] - before
                timeline._add("cpp", start, end)
                timeline._add("kernel", end - wall, end)

        self._restore.append((HostOptimizer, "_cpp_adam", original))
        HostOptimizer._cpp_adam = timed  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for owner, attr, original in reversed(self._restore):
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._restore.clear()

    # ------------------------------------------------------------------ reading
    def summary(self) -> dict[str, Any]:
        """Milliseconds: each phase's span, the worker's jobs and idle gaps, the publishes."""
        with self._lock:
            spans = sorted(self.spans, key=lambda s: s[1])

        def ms(x: float) -> float:
            return round(1e3 * x, 1)

        def first(name: str) -> tuple[str, float, float, str] | None:
            return next((s for s in spans if s[0] == name), None)

        def total(name: str, thread: str | None = None) -> float:
            return ms(sum(e - s for n, s, e, t in spans if n == name and (thread in (None, t))))

        jobs = [s for s in spans if s[0] == "job"]
        gaps = [b[1] - a[2] for a, b in itertools.pairwise(jobs)]
        out: dict[str, Any] = {}
        for phase in ("forward", "backward", "step", "finish", "settle"):
            span = first(phase)
            if span is not None:
                out[phase] = [ms(span[1]), ms(span[2])]
        launches = [s for s in spans if s[0] == "launch"]
        if launches:
            out["launches"] = [len(launches), ms(launches[0][1]), ms(launches[-1][2])]
        if jobs:
            out["jobs"] = {
                "count": len(jobs),
                "first_start": ms(jobs[0][1]),
                "last_end": ms(jobs[-1][2]),
                "busy": ms(sum(e - s for _, s, e, _ in jobs)),
                "idle_between": ms(sum(gaps)),
                "largest_gap": ms(max(gaps, default=0.0)),
                "event_wait": total("event_wait", "slipstream-cpu-step"),
                "hand_over": total("hand_over"),
                "cpu_step": total("cpu_step"),
                "queued_wait_first": ms(next(e - s for n, s, e, _ in spans if n == "queued")),
            }
        publishes = [s for s in spans if s[0] == "publish"]
        if publishes:
            out["publish"] = {
                "count": len(publishes),
                "total": ms(sum(e - s for _, s, e, _ in publishes)),
                "first_start": ms(publishes[0][1]),
                "last_end": ms(publishes[-1][2]),
            }
        forward_publishes = [s for s in spans if s[0] == "forward_publish"]
        if forward_publishes:
            out["forward_publish"] = {
                "count": len(forward_publishes),
                "total": ms(sum(e - s for _, s, e, _ in forward_publishes)),
            }
        out["main_event_wait"] = total("event_wait", "MainThread")
        worker = "slipstream-cpu-step"
        out["worker"] = {
            "kernel": total("kernel", worker),
            "cpp_minus_kernel": ms(
                sum(e - s for n, s, e, t in spans if n == "cpp" and t == worker)
                - sum(e - s for n, s, e, t in spans if n == "kernel" and t == worker)
            ),
            "cpu_step_minus_cpp": ms(
                sum(e - s for n, s, e, t in spans if n == "cpu_step" and t == worker)
                - sum(e - s for n, s, e, t in spans if n == "cpp" and t == worker)
            ),
            "stage": total("stage", worker),
            "not_ready_jobs": sum(1 for n, *_ in spans if n == "not_ready"),
            "merged_calls": sum(1 for n, *_ in spans if n.startswith("merged")),
            "merged_buckets": sum(int(n[6:]) for n, *_ in spans if n.startswith("merged")),
            "idle_queue_empty": ms(self._idle_after(spans, jobs, empty=True)),
            "idle_queue_nonempty": ms(self._idle_after(spans, jobs, empty=False)),
        }
        out["main_kernel"] = total("kernel", "MainThread")
        out["check"] = total("check")
        out["jobs_detail"] = self._jobs_detail(spans, jobs)
        out["earlier_step_periods"] = [ms(p) for p in self.periods]
        return out

    @staticmethod
    def _idle_after(spans: list[Any], jobs: list[Any], empty: bool) -> float:
        """Worker idle time between jobs, where the queue was (not) empty as the job ended."""
        ends = {round(s, 9) for n, s, _, _ in spans if n == "queue_empty"}
        idle = 0.0
        for a, b in itertools.pairwise(jobs):
            if (round(a[2], 9) in ends) == empty:
                idle += b[1] - a[2]
        return idle

    @staticmethod
    def _jobs_detail(spans: list[Any], jobs: list[Any]) -> list[list[float]]:
        """Per job (ms): start, end, its wait for the bucket's copy to the host, its C++
        kernel time, and the rest (Python, the GIL, the early upload)."""
        rows = []
        for _, start, end, thread in jobs:

            def inside(name: str, s0: float = start, e0: float = end, t0: str = thread) -> float:
                return sum(e - s for n, s, e, t in spans if n == name and t == t0 and s0 <= s <= e0)

            wait, kernel = inside("event_wait"), inside("kernel")
            rest = (end - start) - wait - kernel
            rows.append([round(1e3 * x, 1) for x in (start, end, wait, kernel, rest)])
        return rows

    def dump(self, path: Path, rank: int) -> dict[str, Any]:
        """Write the raw spans and the summary to ``path`` (``.rank<r>.json`` appended)."""
        summary = self.summary()
        with self._lock:
            spans = [[n, round(1e3 * s, 3), round(1e3 * e, 3), t] for n, s, e, t in self.spans]
        target = path.with_name(f"{path.name}.rank{rank}.json")
        target.write_text(json.dumps({"summary": summary, "spans_ms": spans}))
        return summary
