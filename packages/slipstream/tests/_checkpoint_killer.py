"""A training loop that checkpoints every step, to be killed with SIGKILL by the tests.

``python _checkpoint_killer.py ROOT WORLD STAGE``: trains the tests' tiny model, and at each
step first records every rank's weights and optimizer state (``ROOT/ref/step<k>.rank<r>.pt``,
and rank 0 the module's state as ``step<k>.full.pt``; written atomically), then saves the checkpoint twice: a new tag ``step<k>`` and a re-save of the
tag ``rolling`` (which ``latest`` names), printing ``saved <k>`` after each step's saves. Runs
until killed (or 200 steps).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def _loop(root: str, stage: int) -> None:
    from slipstream import comm

    sys.path.insert(0, str(Path(__file__).parent))
    from test_checkpoint_reliability import _engine, _snapshot, _train

    base = Path(root)
    rank = comm.get_rank()
    engine = _engine(stage=stage)
    (base / "ref").mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (base / "config.json").write_text(json.dumps({"stage": stage}))
    for step in range(200):
        _train(engine, step, step + 1)
        ref = base / "ref" / f"step{step + 1}.rank{rank}.pt"
        torch.save(_snapshot(engine), ref.with_suffix(".tmp"))
        os.replace(ref.with_suffix(".tmp"), ref)
        if rank == 0:
            full = base / "ref" / f"step{step + 1}.full.pt"
            module_state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
            torch.save(module_state, full.with_suffix(".tmp"))
            os.replace(full.with_suffix(".tmp"), full)
        engine.save_checkpoint(base, tag=f"step{step + 1}", client_state={"step": step + 1})
        engine.save_checkpoint(base, tag="rolling", client_state={"step": step + 1})
        if rank == 0:
            print(f"saved {step + 1}", flush=True)


if __name__ == "__main__":
    from slipstream.comm.testing import run_distributed

    root, world, stage = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    run_distributed(_loop, world, root, stage, timeout=3600)
