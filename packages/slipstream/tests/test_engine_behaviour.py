"""Engine loop semantics: fp16 overflow skipping, no_sync, schedules, progress logging, errors."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.comm.testing import run_distributed


class Linear2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.tanh(self.a(x))).float(), y)


def _data(step: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _fp16_worker() -> dict:
    import slipstream

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "fp16": {
            "enabled": True,
            "auto_cast": True,
            "initial_scale_power": 4,
            "loss_scale_window": 3,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_num_steps": 100,
                "warmup_min_lr": 0.01,
                "warmup_max_lr": 0.1,
                "warmup_type": "linear",
            },
        },
    }
    engine, *_ = slipstream.initialize(model=Linear2(), config=config)
    overflow_steps = {1, 2, 3}
    scales, changed, skipped, lrs = [], [], [], []
    for step in range(8):
        before = [p.detach().clone() for p in engine.module.parameters()]
        x, y = _data(step)
        loss = engine(x, y)
        if step in overflow_steps:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        scales.append(engine.loss_scaler.loss_scale)
        changed.append(
            any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        )
        skipped.append(engine.skipped_steps)
        lrs.append(engine.get_lr()[0])
    dtype = next(engine.module.parameters()).dtype
    return {
        "scales": scales,
        "changed": changed,
        "skipped": skipped,
        "lrs": lrs,
        "dtype": str(dtype),
    }


def test_fp16_overflow_skips_and_scales_like_deepspeed() -> None:
    (result,) = run_distributed(_fp16_worker, 1)
    assert result["dtype"] == "torch.float16"
    # Worked out by hand from DeepSpeed's rules (init 2**4, hysteresis 2, window 3):
    # step 1 overflow uses up the hysteresis (scale kept), steps 2 and 3 halve it, and it
    # doubles after 3 clean iterations counted from the last overflow (step 6).
    assert result["scales"] == [16, 16, 8, 4, 4, 4, 8, 8]
    assert result["changed"] == [True, False, False, False, True, True, True, True]
    assert result["skipped"] == [0, 1, 2, 3, 3, 3, 3, 3]
    # WarmupLR (linear, 0.01 -> 0.1 over 100 steps) advances only on steps that updated the
    # weights: its iteration after each step is the number of applied updates minus one.
    iteration = [0, 0, 0, 0, 1, 2, 3, 4]
    expected = [0.01 + (0.1 - 0.01) * k / 100 for k in iteration]
    assert result["lrs"] == pytest.approx(expected, rel=1e-9)


def _no_sync_worker() -> dict:
    import slipstream
    from slipstream import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
    }
    engine, *_ = slipstream.initialize(model=Linear2(), config=config)
    x, y = _data(10 + rank)
    with engine.no_sync():
        # With GAS 1 every backward ends an accumulation cycle; inside no_sync() none reduces.
        assert engine.is_gradient_accumulation_boundary()
        engine.backward(engine(x, y))
        engine.backward(engine(x, y))
    inside = engine.module.a.weight.grad.clone()
    gathered = [torch.zeros_like(inside) for _ in range(comm.get_world_size())]
    torch.distributed.all_gather(gathered, inside)

    step_error = ""
    with engine.no_sync():
        try:
            engine.step()
        except RuntimeError as error:
            step_error = str(error)

    x2, y2 = _data(20 + rank)
    engine.backward(engine(x2, y2))  # boundary, outside no_sync: reduces everything so far
    reduced = engine.module.a.weight.grad.clone()
    all_reduced = [torch.zeros_like(reduced) for _ in range(comm.get_world_size())]
    torch.distributed.all_gather(all_reduced, reduced)
    return {
        "ranks_differ_inside": not torch.equal(gathered[0], gathered[1]),
        "ranks_agree_after": torch.equal(all_reduced[0], all_reduced[1]),
        "step_error": step_error,
    }


def test_no_sync_defers_reduction() -> None:
    for result in run_distributed(_no_sync_worker, 2):
        assert result["ranks_differ_inside"]
        assert result["ranks_agree_after"]
        assert "inside engine.no_sync()" in result["step_error"]


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(input_ids))
        return F.cross_entropy(logits[:, :-1].reshape(-1, 16), input_ids[:, 1:].reshape(-1))


def _logging_worker() -> dict:
    import slipstream

    handler = ListHandler()
    package_logger = logging.getLogger("slipstream")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
    }
    engine, *_ = slipstream.initialize(model=TokenModel(), config=config)
    losses = []
    for step in range(4):
        ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = engine(ids)
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
    return {"lines": handler.lines, "losses": losses, "report_loss": engine.last_report.loss}


def test_progress_log_lines() -> None:
    (result,) = run_distributed(_logging_worker, 1)
    progress = [line for line in result["lines"] if line.startswith("step=")]
    assert [line.split()[0] for line in progress] == ["step=2", "step=4"]
    for field in ("loss=", "lr=", "grad_norm=", "samples/s=", "tokens/s="):
        assert field in progress[0], progress[0]
    # The logged loss is the mean of the micro-batch losses since the previous line.
    assert math.isclose(result["report_loss"], sum(result["losses"][2:]) / 2, rel_tol=1e-6)
    assert any("forward:" in line and "backward:" in line for line in result["lines"])


def _error_worker() -> dict:
    import slipstream

    messages = {}
    try:
        slipstream.initialize(model=Linear2())
    except ValueError as error:
        messages["no_config"] = str(error)
    engine, *_ = slipstream.initialize(
        model=Linear2(),
        config={"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    x, y = _data(0)
    out = engine(x, y)
    try:
        engine.backward(torch.stack([out, out]))
    except TypeError as error:
        messages["non_scalar"] = str(error)
    return messages


def test_initialize_and_backward_errors() -> None:
    (messages,) = run_distributed(_error_worker, 1)
    assert "no Slipstream/DeepSpeed config" in messages["no_config"]
    assert "scalar loss" in messages["non_scalar"]
