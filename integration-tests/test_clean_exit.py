"""The README's demo, shortened, exits 0 every time through the launcher (issue 22's abort).

Each run trains a few steps on 2 ranks, checkpoints, resumes and ends with comm.destroy() and
interpreter exit, the path that used to abort with SIGABRT in a large fraction of runs. Runs
alternate between the demo's stage-0 config and ZeRO stage 2 with the optimizer on the CPU.
``tools/exit_check.py --runs 50`` is the long version of this test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.comm.distributed import free_port

RUNS = 4


def _config(stage: int) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": stage},
    }
    if stage:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


@pytest.mark.slow
def test_demo_exits_cleanly_every_time(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failures = []
    for run in range(RUNS):
        stage = 0 if run % 2 == 0 else 2
        config = tmp_path / f"config{run}.json"
        config.write_text(json.dumps(_config(stage)))
        command = [
            sys.executable, "-m", "slipstream.cli", "run", "--num_procs", "2",
            "--master_port", str(free_port()), "--module", "slipstream.examples.gpt",
            "--out", str(tmp_path / f"run{run}"), "--steps", "4", "--save_at", "2",
            "--seq", "16", "--deepspeed_config", str(config),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or "terminate called" in done.stderr:
            failures.append(
                f"run {run} (stage {stage}): exit {done.returncode}\n{done.stderr[-2000:]}"
            )
    assert not failures, "\n\n".join(failures)
