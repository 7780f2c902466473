"""Spawned host-side bench workers that start together and each report one result."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
from collections.abc import Callable
from typing import Any


def run_host_workers(
    target: Callable[[int, argparse.Namespace, Any, Any], None],
    args: argparse.Namespace,
    processes: int,
) -> list[Any]:
    """Run ``target(rank, args, barrier, results)`` in ``processes`` spawned processes (the
    barrier lines their timed rounds up; each puts one item into ``results``) and return the
    items in arrival order. A worker that exits without its item (a crash, a missing
    extension) stops the others and raises ``SystemExit`` naming it, instead of leaving the
    others waiting at the barrier and this process waiting on the queue."""
    context = mp.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=target, args=(rank, args, barrier, results))
        for rank in range(processes)
    ]
    for worker in workers:
        worker.start()
    gathered: list[Any] = []
    try:
        while len(gathered) < processes:
            try:
                gathered.append(results.get(timeout=2.0))
            except queue.Empty:
                failed = [r for r, w in enumerate(workers) if w.exitcode not in (None, 0)]
                if failed:
                    codes = ", ".join(f"rank {r}: exit code {workers[r].exitcode}" for r in failed)
                    message = f"a bench worker failed ({codes}); its traceback is above"
                    raise SystemExit(message) from None
    finally:
        for worker in workers:
            if len(gathered) < processes:
                worker.terminate()
            worker.join()
    return gathered
