"""How many CPU threads the offloaded optimizer step uses, and why (stated in the log).

torchrun sets ``OMP_NUM_THREADS=1`` in every worker so that N processes on one host do not
oversubscribe its cores. For a CPU optimizer step that is ruinous: the step over a billion
fp32 values is memory-bound and needs many threads to reach the host's bandwidth (DeepSpeed's
CPU-offload runs crawl under torchrun for this reason). Slipstream therefore gives the step its
share of the cores this process may run on: ``affinity / local ranks * cpuadam_cores_perc``,
unless the user chose explicitly (``offload_optimizer.threads`` in the config, or an
``OMP_NUM_THREADS`` that neither torchrun nor ``slipstream run`` set). Only the optimizer extension's OpenMP pool is resized; torch's
intra-op threads stay as the launcher set them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ThreadChoice", "choose_threads"]


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """The thread count for the CPU optimizer and the sentence that explains it."""

    threads: int
    reason: str


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _launcher_default(omp: str) -> str | None:
    """Which launcher set ``OMP_NUM_THREADS`` to ``omp`` by default (None: the user did)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return "torchrun"
    from slipstream.comm.launcher.environment import OMP_DEFAULTED_ENV

    if os.environ.get(OMP_DEFAULTED_ENV, "").strip() == omp:
        return "slipstream run"
    return None


def choose_threads(cores_fraction: float = 0.8, threads: int = 0) -> ThreadChoice:
    """The OpenMP threads of the CPU optimizer step in this process.

    Args:
        cores_fraction: the share of this rank's cores the step may use (DeepSpeed's
            ``offload_optimizer.cpuadam_cores_perc``); the rest stays free for the data
            loader and the Python thread that drives the GPU.
        threads: an explicit count (``offload_optimizer.threads``); 0 chooses.
    """
    if threads < 0:
        raise ValueError(f"offload_optimizer.threads={threads} must be >= 0 (0: choose)")
    if threads:
        return ThreadChoice(threads, f"offload_optimizer.threads={threads}")
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    launcher = _launcher_default(omp) if omp else None
    if omp and launcher is None:
        try:
            return ThreadChoice(max(1, int(omp)), f"OMP_NUM_THREADS={omp} (set by the user)")
        except ValueError:
            pass  # a malformed value: OpenMP ignores it too; choose below
    cores = _available_cores()
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    share = max(1, cores // local)
    chosen = max(1, int(share * cores_fraction))
    reason = f"{cores} cores / {local} local rank(s) x cpuadam_cores_perc {cores_fraction:g}"
    if omp:
        reason += f"; {launcher}'s OMP_NUM_THREADS={omp} applies to torch's ops only"
    return ThreadChoice(chosen, reason)
