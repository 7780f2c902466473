"""A rank that dies mid-run makes the others fail fast with an error, not hang, and exit."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.comm.distributed import free_port

_JOB = Path(__file__).with_name("dying_rank_job.py")


@pytest.mark.slow
def test_the_surviving_rank_raises_and_exits() -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(_JOB)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=240) for proc in procs]
    elapsed = time.monotonic() - started
    assert procs[1].returncode == 3
    out, err = outputs[0]
    assert procs[0].returncode == 5, f"rank 0 exited {procs[0].returncode}:\n{out}\n{err[-2000:]}"
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert failed and "RuntimeError" in failed[0], out
    seconds = float(failed[0].split()[1])
    assert seconds < 30, f"the surviving rank noticed only after {seconds} s"
    # Its exit is not held up for long by collectives the dead peer never finished.
    assert elapsed < 120, elapsed
    assert "terminate called" not in err
