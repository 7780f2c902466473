"""initialize() compares the config and the model across ranks and names the first difference."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.comm.testing import run_distributed


def _model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def _config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    config.update(overrides)
    return config


def _agreement_worker() -> list[str | None]:
    import slipstream
    from slipstream.runtime.agreement import RanksDisagreeError

    rank = slipstream.comm.get_rank()
    outcomes: list[str | None] = []
    cases = [
        (_model(8), _config()),  # equal everywhere: no error
        (_model(8), _config(zero_optimization={"stage": 2 if rank == 1 else 1})),
        (_model(9 if rank == 1 else 8), _config()),
        (_model(8), _config(gradient_clipping=1.0 if rank == 0 else 0.5)),
    ]
    for model, config in cases:
        try:
            slipstream.initialize(model=model, config=config)
            outcomes.append(None)
        except RanksDisagreeError as error:
            outcomes.append(str(error))
    return outcomes


def test_initialize_names_the_first_difference_on_every_rank() -> None:
    rank0, rank1 = run_distributed(_agreement_worker, 2, timeout=180)
    assert rank0 == rank1, "every rank must raise the same error"
    same, stage, shape, clipping = rank0
    assert same is None
    assert stage is not None and "'zero_optimization.stage' is 1 on rank 0 but 2 on rank 1" in stage
    assert shape is not None and "'0.weight' has shape (8, 6)" in shape and "(9, 6)" in shape
    assert clipping is not None and "'gradient_clipping' is 1.0 on rank 0 but 0.5" in clipping
