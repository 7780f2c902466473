"""Processes exit with code 0 while torch's communication threads still hold collective tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.comm.distributed import free_port

_JOB = Path(__file__).with_name("exit_job.py")


def _run_world(mode: str, world_size: int = 2) -> list[tuple[int, str]]:
    """Start ``world_size`` ranks of exit_job.py; (exit code, stderr) of each."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["WORLD_SIZE"] = str(world_size)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    for rank in range(world_size):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(_JOB), mode],
                env=rank_env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        results.append((proc.returncode, err))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["destroy", "exit"])
def test_exit_is_clean_while_a_collective_completes_late(mode: str) -> None:
    # Before slipstream.comm held collective tensors (comm/in_flight.py), rank 0 died here
    # with "terminate called without an active exception" (exit code -6 / 134).
    for rank, (code, err) in enumerate(_run_world(mode)):
        assert code == 0, f"rank {rank} exited with {code}:\n{err[-3000:]}"
        assert "terminate called" not in err
