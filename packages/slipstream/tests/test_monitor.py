"""Monitors: the engine's DeepSpeed events in csv_monitor and TensorBoard files, rank 0 only."""

from __future__ import annotations

import csv
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.comm.testing import run_distributed
from slipstream.config.monitor import (
    CometConfig,
    CsvMonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from slipstream.monitor import MonitorMaster

MICRO, GAS, STEPS = 4, 2, 3


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.tanh(self.a(x))).float(), y)


def _train(out: str, fp16: bool, tensorboard: bool) -> dict[str, Any]:
    """A few GAS-2 steps with csv_monitor (and tensorboard) on; what the engine computed."""
    import slipstream
    from slipstream import comm

    rank = comm.get_rank()
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 4, "warmup_min_lr": 0.0, "warmup_max_lr": 0.1},
        },
        "wall_clock_breakdown": True,
        # A job folder per rank: only rank 0's may appear.
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": f"csv{rank}"},
        "tensorboard": {"enabled": tensorboard, "output_path": out, "job_name": f"tb{rank}"},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "auto_cast": True, "initial_scale_power": 4}
    engine, *_ = slipstream.initialize(model=Tiny(), config=config)
    assert engine.monitor.enabled  # on every rank; only rank 0 has backends
    assert len(engine.monitor.backends) == (1 + tensorboard if rank == 0 else 0)
    window_losses, lrs, scales = [], [], []
    for step in range(STEPS):
        total = None
        for micro in range(GAS):
            g = torch.Generator().manual_seed(100 * rank + 10 * step + micro)
            x, y = torch.randn(MICRO, 6, generator=g), torch.randint(0, 3, (MICRO,), generator=g)
            scaled = engine.backward(engine(x, y))  # loss / GAS, as DeepSpeed sums it
            total = scaled.float() if total is None else total + scaled.float()
            engine.step()
        window_losses.append(float(total))  # type: ignore[arg-type]
        lrs.append(engine.get_lr()[0])
        scales.append(engine.loss_scaler.loss_scale if fp16 else None)
    engine.monitor.write_events([("Eval/Samples/user metric", 0.5, engine.global_samples)])
    engine.destroy()
    return {"losses": window_losses, "lrs": lrs, "scales": scales}


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as file:
        header, *rows = list(csv.reader(file))
    return header, [(int(step), float(value)) for step, value in rows]


def _check_csv(folder: Path, result: dict[str, Any], batch: int, fp16: bool) -> None:
    steps_before = [batch * i for i in range(STEPS)]
    steps_after = [batch * (i + 1) for i in range(STEPS)]
    header, rows = _read_csv(folder / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    # DeepSpeed writes the loss from the window's last backward, before the step counts it.
    assert rows == list(zip(steps_before, result["losses"]))
    header, rows = _read_csv(folder / "Train_Samples_lr.csv")
    assert header == ["step", "lr"]
    assert rows == list(zip(steps_after, result["lrs"]))
    assert (folder / "Train_Samples_loss_scale.csv").exists() == fp16
    if fp16:
        assert _read_csv(folder / "Train_Samples_loss_scale.csv")[1] == list(
            zip(steps_after, result["scales"])
        )
    for name in ("forward", "backward", "step"):
        header, rows = _read_csv(folder / f"Train_Samples_elapsed_time_ms_{name}.csv")
        assert header == ["step", f"elapsed_time_ms_{name}"]
        assert [s for s, _ in rows] == steps_after and all(ms > 0 for _, ms in rows)
    # The user's own event: spaces become underscores in the file name.
    header, rows = _read_csv(folder / "Eval_Samples_user_metric.csv")
    assert header == ["step", "user metric"] and rows == [(batch * STEPS, 0.5)]


def test_csv_and_tensorboard_hold_the_engines_losses_and_lrs(tmp_path: Path) -> None:
    """One spawned world of 2 (CI cost): rank 0's files hold what its engine computed, and
    rank 1 writes nothing."""
    has_tensorboard = True
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        has_tensorboard = False
    results = run_distributed(_train, 2, str(tmp_path), True, has_tensorboard)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["csv0"] + ["tb0"] * has_tensorboard
    assert results[0]["lrs"][0] < results[0]["lrs"][-1]  # the warm-up moves the lr
    # Rank 0's own losses (DeepSpeed does not average train_loss over ranks).
    assert results[0]["losses"] != results[1]["losses"]
    batch = MICRO * GAS * 2
    _check_csv(tmp_path / "csv0", results[0], batch, fp16=True)
    if not has_tensorboard:
        pytest.skip("tensorboard is not installed: the CSV half ran, the TensorBoard half did not")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb0"))
    events.Reload()
    for name, key, offset in (
        ("Train/Samples/train_loss", "losses", 0),
        ("Train/Samples/lr", "lrs", 1),
        ("Train/Samples/loss_scale", "scales", 1),
    ):
        scalars = events.Scalars(name)
        assert [e.step for e in scalars] == [batch * (i + offset) for i in range(STEPS)]
        # TensorBoard stores float32.
        assert [e.value for e in scalars] == [
            float(torch.tensor(v, dtype=torch.float32)) for v in results[0][key]
        ]
    assert [e.value for e in events.Scalars("Eval/Samples/user metric")] == [0.5]


def test_csv_files_are_appended_with_a_header_per_monitor(tmp_path: Path) -> None:
    config = CsvMonitorConfig(enabled=True, output_path=str(tmp_path), job_name="j")
    for value in (1.0, 2.0):
        master = MonitorMaster(csv_monitor=config, rank=0)
        master.write_events([("a/b", value, 3), ("a/b", value + 0.5, 4)])
        master.close()
    with open(tmp_path / "j" / "a_b.csv") as file:
        assert file.read().splitlines() == ["step,b", "3,1.0", "4,1.5", "step,b", "3,2.0", "4,2.5"]
    elsewhere = MonitorMaster(csv_monitor=config, tensorboard=TensorBoardConfig(), rank=1)
    assert elsewhere.enabled and elsewhere.backends == []
    assert not MonitorMaster(tensorboard=TensorBoardConfig(), rank=0).enabled


def test_wandb_run_gets_deepspeeds_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any, Any]] = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw, None))  # type: ignore[attr-defined]
    fake.log = lambda data, step: calls.append(("log", data, step))  # type: ignore[attr-defined]
    fake.finish = lambda: calls.append(("finish", None, None))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    master = MonitorMaster(wandb=WandbConfig(enabled=True, team="t"), rank=0)
    master.write_events([("Train/Samples/lr", 0.1, 8), ("Train/Samples/loss_scale", 16.0, 8)])
    master.close()
    assert calls == [
        ("init", {"project": "deepspeed", "group": None, "entity": "t"}, None),
        ("log", {"Train/Samples/lr": 0.1}, 8),
        ("log", {"Train/Samples/loss_scale": 16.0}, 8),
        ("finish", None, None),
    ]


def test_comet_logs_each_name_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: list[tuple[str, float, int]] = []
    started: dict[str, Any] = {}

    class Experiment:
        def set_name(self, name: str) -> None:
            started["name"] = name

        def log_metric(self, name: str, value: float, step: int) -> None:
            logged.append((name, value, step))

        def end(self) -> None:
            started["ended"] = True

    fake = types.ModuleType("comet_ml")
    fake.__version__ = "3.45.0"  # type: ignore[attr-defined]
    fake.start = lambda **kw: started.update(kw) or Experiment()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    config = CometConfig(enabled=True, samples_log_interval=16, online=False, experiment_name="e")
    master = MonitorMaster(comet=config, rank=0)
    for samples in (8, 16, 24, 32, 40):
        master.write_events([("lr", samples / 10, samples), ("loss", samples / 100, samples)])
    master.close()
    assert started["online"] is False and started["mode"] is None and started["name"] == "e"
    assert started["ended"]
    assert [(n, s) for n, _, s in logged] == [
        ("lr", 8),
        ("loss", 8),
        ("lr", 24),
        ("loss", 24),
        ("lr", 40),
        ("loss", 40),
    ]
    fake.__version__ = "3.40.2"  # type: ignore[attr-defined]
    with pytest.raises(ImportError, match=r"comet_ml >= 3.41.*found 3.40.2"):
        MonitorMaster(comet=config, rank=0)


@pytest.mark.parametrize(
    ("key", "module", "block"),
    [
        ("wandb", "wandb", WandbConfig(enabled=True)),
        ("comet", "comet_ml", CometConfig(enabled=True)),
        ("tensorboard", "tensorboard", TensorBoardConfig(enabled=True)),
    ],
)
def test_missing_library_names_the_package(
    monkeypatch: pytest.MonkeyPatch, key: str, module: str, block: Any
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(ImportError) as info:
        MonitorMaster(**{key: block}, rank=0)
    message = str(info.value)
    assert f"needs the '{module}' package" in message
    assert f"pip install {module}" in message and f"slipstream[{key}]" in message
    assert f"{key}.enabled to false" in message
    # Other ranks never import it.
    assert MonitorMaster(**{key: block}, rank=1).backends == []
