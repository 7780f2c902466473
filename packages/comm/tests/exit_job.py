"""A rank of test_clean_exit's jobs: a collective still held by torch's thread as the process exits.

Run as a script by the test with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set. Rank 0 issues an
all-reduce and drops the tensor at once; rank 1 joins it one second later, so rank 0's gloo
worker finishes (and drops its reference to) the tensor only after rank 0 reached exit. An object
freed during interpreter finalization sleeps two seconds, which puts that moment inside
finalization, where a thread that asks for the GIL is ended (the abort of issue 22).
"""

from __future__ import annotations

import sys
import time

import torch

from slipstream import comm


class _SlowToFree:
    """Keeps the interpreter in finalization for a while (released by module teardown)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.sleep = time.sleep  # bound now: modules are being torn down when __del__ runs

    def __del__(self) -> None:
        self.sleep(self.seconds)


def main(mode: str) -> None:
    comm.init_distributed(dist_backend="gloo")
    rank = comm.get_rank()
    if rank == 0:
        comm.all_reduce(torch.ones(8), async_op=True)  # tensor and Work dropped at once
    else:
        time.sleep(1.0)
        comm.all_reduce(torch.ones(8))
    if mode == "destroy":
        comm.destroy()
    # mode "exit": the user never calls destroy(); the atexit hook must cover it.


_finalizer = _SlowToFree(2.0)

if __name__ == "__main__":
    main(sys.argv[1])
