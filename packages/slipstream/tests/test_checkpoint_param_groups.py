"""A reloaded optimizer keeps torch's ``param_groups`` types: Adam's ``betas`` is a tuple again.

The manifest stores the groups as JSON (no tuples); every checkpoint layout rebuilds them
through ``checkpoint.saved_param_groups``. One process, world size 1: stage 0 (its own
layout), stages 1 and 3 (the ZeRO layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.runtime.checkpoint import saved_param_groups


def test_saved_param_groups_restores_tuples_and_keeps_params() -> None:
    current = [{"params": [0, 1], "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}]
    saved = [{"params": [7], "lr": 5e-4, "betas": [0.8, 0.99], "extra": [1, 2]}]
    (group,) = saved_param_groups(saved, current)
    assert group["params"] == [0, 1]
    assert group["lr"] == 5e-4
    assert group["betas"] == (0.8, 0.99) and isinstance(group["betas"], tuple)
    assert group["extra"] == [1, 2]  # unknown here: left as saved


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_betas_are_a_tuple_after_reload(tmp_path: Path, stage: int) -> None:
    import slipstream

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.99]}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = slipstream.initialize(model=torch.nn.Linear(4, 2), config=config)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path)
    engine.load_checkpoint(tmp_path)
    betas = engine.optimizer.param_groups[0]["betas"]
    assert isinstance(betas, tuple), f"stage {stage}: betas came back as {type(betas).__name__}"
    assert betas == (0.8, 0.99)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()  # the reloaded optimizer still steps
    engine.destroy()
