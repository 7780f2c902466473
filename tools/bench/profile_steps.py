"""A few training steps under torch.profiler, summarised per rank (train_bench.py --profile).

The summary answers "where does a step's time go": the step's wall time, how long the GPU was
busy (the union of its kernels, copies and fills), how much of it NCCL kernels took, how much
compute kernels took, how much communication ran with no compute beside it (exposed), the idle
gaps, the top kernels, and the host: time blocked in synchronising CUDA calls, ``.item()``-style
reads, and (with ``stack=True``) the Python functions of the library by inclusive time. Without
CUDA (a CPU smoke run) the "kernels" are the CPU operators and the rest is the same.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaStreamWaitEvent",
    "cudaMemcpy",
)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted, non-overlapping intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the merged intervals ``a`` not covered by the merged intervals ``b``."""
    total, j = 0.0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                total += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def _is_comm(name: str) -> bool:
    lowered = name.lower()
    if "nccl" in lowered or lowered.startswith("gloo") or "c10d::" in lowered:
        return True
    # publish_transport copy_engine: peer copies (copy engines) and symmetric-memory barriers.
    return "ptop" in lowered or "barrier_kernel" in lowered


def summarise(trace: dict[str, Any], steps: int, wall_ms: float, cuda: bool) -> dict[str, Any]:
    """The per-rank summary of one chrome trace of ``steps`` steps taking ``wall_ms`` in all."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if cuda:
        device = [e for e in events if e.get("cat") in _DEVICE_CATS]
    else:  # CPU smoke run: the operators stand in for kernels
        device = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device]
    comm = _union([s for s, e in zip(spans, device, strict=True) if _is_comm(e["name"])])
    compute = _union(
        [
            s
            for s, e in zip(spans, device, strict=True)
            if not _is_comm(e["name"]) and e.get("cat") != "user_annotation"
        ]
    )
    busy = _union(spans)
    per = 1e-3 / steps  # us over the window -> ms per step
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in device:
        if e.get("cat") == "user_annotation":
            continue
        entry = by_name[e["name"]]
        entry[0] += float(e["dur"])
        entry[1] += 1
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]
    streams: dict[str, float] = defaultdict(float)
    for e in device:
        if e.get("cat") in _DEVICE_CATS:
            streams[str(e.get("args", {}).get("stream", "?"))] += float(e["dur"])
    host: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        name = e["name"]
        if e.get("cat") == "cuda_runtime" and name.startswith(_SYNC_CALLS):
            pass
        elif name in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero"):
            pass
        else:
            continue
        host[name][0] += float(e["dur"])
        host[name][1] += 1
    library: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") != "python_function":
            continue
        name = e["name"]
        if "slipstream" in name and "site-packages/torch" not in name:
            library[name] += float(e["dur"])  # inclusive (nested calls count in each)
    exposed = _minus(comm, compute)
    return {
        "steps": steps,
        "wall_ms": round(wall_ms / steps, 2),
        "busy_ms": round(_length(busy) * per, 2),
        "idle_ms": round(max(wall_ms / steps - _length(busy) * per, 0.0), 2),
        "comm_ms": round(_length(comm) * per, 2),
        "compute_ms": round(_length(compute) * per, 2),
        "exposed_comm_ms": round(exposed * per, 2),
        "overlapped_comm_ms": round((_length(comm) - exposed) * per, 2),
        "kernels_per_step": round(sum(v[1] for v in by_name.values()) / steps, 1),
        "stream_busy_ms": {k: round(v * per, 2) for k, v in sorted(streams.items())},
        "top": [
            {"name": name[:90], "ms": round(total * per, 2), "calls": round(calls / steps, 1)}
            for name, (total, calls) in top
        ],
        "host_sync": {
            name: {"ms": round(total * per, 2), "calls": round(calls / steps, 1)}
            for name, (total, calls) in sorted(host.items(), key=lambda kv: -kv[1][0])
        },
        "library_python_ms": {
            name[:110]: round(total * per, 2)
            for name, total in sorted(library.items(), key=lambda kv: -kv[1])[:25]
        },
    }


def profile(
    step: Callable[[], Any],
    sync: Callable[[], None],
    *,
    steps: int,
    path: Path,
    rank: int,
    stack: bool = False,
) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under the profiler; rank 0 keeps its chrome trace at
    ``path`` (other ranks' traces are parsed and deleted). Returns the rank's summary."""
    from torch.profiler import ProfilerActivity

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    pauses: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    sync()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    host: list[float] = []
    gc.callbacks.append(on_gc)
    try:
        with torch.profiler.profile(activities=activities, with_stack=stack) as prof:
            start = time.perf_counter()
            if events:
                events[0].record()
            for index in range(steps):
                begin = time.perf_counter()
                with torch.profiler.record_function(f"bench_step_{index}"):
                    step()
                host.append(1e3 * (time.perf_counter() - begin))
                if events:
                    events[index + 1].record()
            sync()
            wall_ms = 1e3 * (time.perf_counter() - start)
    finally:
        gc.callbacks.remove(on_gc)
    gpu_steps = [a.elapsed_time(b) for a, b in itertools.pairwise(events)]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = path
    else:
        handle, name = tempfile.mkstemp(suffix=f".rank{rank}.json")
        os.close(handle)
        target = Path(name)
    prof.export_chrome_trace(str(target))
    with target.open() as handle:
        trace = json.load(handle)
    if rank != 0:
        target.unlink()
    summary = summarise(trace, steps, wall_ms, cuda)
    # Per step: the host's time in step() (enqueueing; close to the GPU's when the host is
    # the bottleneck or waits on it) and, with CUDA, the stream's time between step marks.
    summary["host_step_ms"] = [round(t, 1) for t in host]
    summary["gpu_step_ms"] = [round(t, 1) for t in gpu_steps]
    summary["gc_ms"] = round(1e3 * sum(pauses) / steps, 2)
    summary["gc_collections"] = round(len(pauses) / steps, 1)
    return summary


def format_summary(rank: int, summary: dict[str, Any]) -> str:
    """A compact, human-readable block (one JSON line follows it for tools)."""
    lines = [
        f"PROFILE rank {rank}: per step wall {summary['wall_ms']} ms, GPU busy "
        f"{summary['busy_ms']} (idle {summary['idle_ms']}), compute {summary['compute_ms']}, "
        f"comm {summary['comm_ms']} (exposed {summary['exposed_comm_ms']}, overlapped "
        f"{summary['overlapped_comm_ms']}), {summary['kernels_per_step']} kernels/step, "
        f"streams {summary['stream_busy_ms']}",
        f"  steps: host {summary['host_step_ms']} ms, GPU {summary['gpu_step_ms']} ms; Python GC "
        f"{summary['gc_ms']} ms/step ({summary['gc_collections']} collections/step)",
        "  host syncs: "
        + (
            ", ".join(f"{k} {v['ms']} ms x{v['calls']}" for k, v in summary["host_sync"].items())
            or "none"
        ),
    ]
    lines += [f"  {t['ms']:>9.2f} ms {t['calls']:>7} x {t['name']}" for t in summary["top"]]
    if summary["library_python_ms"]:
        lines.append("  library python (inclusive ms/step):")
        lines += [f"  {v:>9.2f} {k}" for k, v in list(summary["library_python_ms"].items())[:15]]
    return "\n".join(lines)
