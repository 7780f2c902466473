"""fp32/bf16 steps with an inf or nan loss or gradient are skipped on every rank, with a warning.

Each case trains two engines side by side from the same weights: one sees a poisoned micro-batch
at step BAD (on one rank only, to test that the ranks agree), the other never sees that batch.
The skipped step must leave weights and optimizer state exactly as they were, and the two runs
must stay bit-for-bit equal afterwards.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.comm.testing import run_distributed

STEPS = 4
BAD = 1  # the poisoned step


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.tanh(self.a(x))).float(), y)


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _config(precision: str, stage: int, offload: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


def _poisoned_loss(loss: torch.Tensor, model: nn.Module, kind: str) -> torch.Tensor:
    if kind == "nan_loss":
        return loss * float("nan")  # loss and every gradient nan
    if kind == "inf_loss":
        return loss + torch.tensor(float("inf"))  # the loss alone: gradients stay finite
    # "inf_grad": a finite loss whose gradient is not (d sqrt(x)/dx at 0 is inf, times 0: nan)
    weight = next(model.parameters())
    return loss + torch.sqrt(weight.sum() * 0.0)


def _optimizer_state(engine: Any) -> list[torch.Tensor]:
    state = engine.optimizer.state
    return [
        value.detach().float().clone()
        for param_state in state.values()
        for value in param_state.values()
        if isinstance(value, torch.Tensor)
    ]


def _params(engine: Any) -> list[torch.Tensor]:
    engine.wait_for_step()
    params = list(engine.module.parameters())
    if engine.zero_stage == 3:
        from slipstream.zero import GatheredParameters

        with GatheredParameters(params):
            return [p.detach().float().clone() for p in params]
    return [p.detach().float().clone() for p in params]


def _cases_worker(cases: list[tuple[str, int, bool, str]]) -> list[str]:
    """Run every case in this world; returns a description of each failed check."""
    import slipstream
    from slipstream import comm

    rank = comm.get_rank()
    world = comm.get_world_size()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("slipstream.runtime.engine").addHandler(handler)
    problems: list[str] = []
    for precision, stage, offload, kind in cases:
        name = f"{precision} stage {stage}{' offload' if offload else ''} {kind} world {world}"
        torch.manual_seed(0)
        model = Tiny()
        twin = Tiny()
        twin.load_state_dict(model.state_dict())
        config = _config(precision, stage, offload)
        engine, *_ = slipstream.initialize(model=model, config=config)
        reference, *_ = slipstream.initialize(model=twin, config=config)
        records.clear()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for step in range(STEPS):
            x, y = _data(step, rank)
            x = x.to(dtype)
            if step == BAD:
                before, state_before = _params(engine), _optimizer_state(engine)
                loss = engine(x, y)
                # Poisoned on the last rank only: the others must skip too.
                if rank == world - 1:
                    loss = _poisoned_loss(loss, engine.module, kind)
                engine.backward(loss)
                engine.step()
                after, state_after = _params(engine), _optimizer_state(engine)
                if not all(torch.equal(b, a) for b, a in zip(before, after)):
                    problems.append(f"{name}: the skipped step changed the weights")
                if len(state_before) != len(state_after) or not all(
                    torch.equal(b, a) for b, a in zip(state_before, state_after)
                ):
                    problems.append(f"{name}: the skipped step changed the optimizer state")
                if engine.nonfinite_skipped_steps != 1 or engine.skipped_steps != 1:
                    problems.append(f"{name}: counter {engine.nonfinite_skipped_steps}")
                continue
            for run in (engine, reference):
                run.backward(run(x, y))
                run.step()
        warnings = [
            r for r in records if r.levelno == logging.WARNING and "non-finite" in r.getMessage()
        ]
        if rank == 0 and len(warnings) != 1:
            problems.append(f"{name}: {len(warnings)} warnings about the skipped step")
        if rank == 0 and warnings and "1 step(s) skipped" not in warnings[0].getMessage():
            problems.append(f"{name}: the warning lacks the count: {warnings[0].getMessage()}")
        final, expected = _params(engine), _params(reference)
        if not all(torch.equal(f, e) for f, e in zip(final, expected)):
            diff = max(float((f - e).abs().max()) for f, e in zip(final, expected))
            problems.append(f"{name}: differs from the run without the bad batch by {diff:g}")
        if not all(torch.isfinite(p).all() for p in final):
            problems.append(f"{name}: non-finite weights at the end")
        engine.destroy()
        reference.destroy()
    return problems


_CASES = [
    ("fp32", 0, False, "nan_loss"),
    ("fp32", 0, False, "inf_loss"),
    ("bf16", 0, False, "inf_grad"),
    ("fp32", 2, False, "inf_grad"),
    ("bf16", 1, False, "nan_loss"),
    ("bf16", 2, True, "inf_loss"),
    ("fp32", 2, True, "nan_loss"),
    ("fp32", 3, False, "inf_loss"),
    ("bf16", 3, False, "nan_loss"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_nonfinite_steps_are_skipped_everywhere(world_size: int) -> None:
    results = run_distributed(_cases_worker, world_size, _CASES, timeout=300)
    problems = [p for rank_problems in results for p in rank_problems]
    assert not problems, "\n".join(problems)


def test_the_check_can_be_turned_off() -> None:
    from slipstream.config import load_config

    batch = {"train_micro_batch_size_per_gpu": 1}
    assert load_config(batch, world_size=1).check_grad_overflow is True
    assert load_config(batch, world_size=1).bf16.check_grad_overflow is True
    off = load_config({**batch, "check_grad_overflow": False, "bf16": {"check_overflow": False}}, 1)
    assert off.check_grad_overflow is False and off.bf16.check_grad_overflow is False
