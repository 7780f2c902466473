"""save_checkpoint -> load_checkpoint -> continue is bit-identical; bad checkpoints fail clearly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.comm.testing import run_distributed


class DropoutNet(nn.Module):
    """Dropout makes the RNG part of the state that must be restored."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 32)
        self.drop = nn.Dropout(0.3)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Inputs arrive in fp32; like DeepSpeed, the engine casts them only under fp16.auto_cast.
        x = x.to(self.a.weight.dtype)
        return F.cross_entropy(self.b(self.drop(torch.relu(self.a(x)))).float(), y)


def _config(precision: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01},
        },
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return config


def _run_steps(engine, first: int, last: int) -> list[float]:
    from slipstream import comm

    rank = comm.get_rank()
    losses = []
    for step in range(first, last):
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x, y = torch.randn(4, 10, generator=g), torch.randint(0, 4, (4,), generator=g)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def _resume_worker(save_dir: str, precision: str) -> dict:
    import slipstream

    torch.manual_seed(0)
    model = DropoutNet()
    engine, *_ = slipstream.initialize(model=model, config=_config(precision))
    first_half = _run_steps(engine, 0, 3)
    engine.save_checkpoint(save_dir, client_state={"note": "half-way", "step": 3})
    uninterrupted = _run_steps(engine, 3, 6)
    final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    torch.manual_seed(123)  # a different init and RNG stream: the checkpoint must restore both
    model2 = DropoutNet()
    engine2, *_ = slipstream.initialize(model=model2, config=_config(precision))
    path, client_state = engine2.load_checkpoint(save_dir)
    resumed = _run_steps(engine2, 3, 6)
    identical = all(torch.equal(final[n], p.detach()) for n, p in engine2.module.named_parameters())
    return {
        "first_half": first_half,
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "identical": identical,
        "client_state": client_state,
        "path": str(path),
        "steps": (engine.global_steps, engine2.global_steps),
        "lr": (engine.get_lr(), engine2.get_lr()),
        "scale": (
            engine.loss_scaler.loss_scale if engine.loss_scaler else None,
            engine2.loss_scaler.loss_scale if engine2.loss_scaler else None,
        ),
    }


@pytest.mark.parametrize(
    ("world_size", "precision"), [(1, "fp32"), (2, "fp32"), (2, "bf16"), (1, "fp16")]
)
def test_resume_is_bit_identical(tmp_path: Path, world_size: int, precision: str) -> None:
    results = run_distributed(_resume_worker, world_size, str(tmp_path / "ckpt"), precision)
    for result in results:
        assert result["resumed"] == result["uninterrupted"]  # exact float equality
        assert result["identical"]
        assert result["client_state"] == {"note": "half-way", "step": 3}
        assert result["steps"] == (6, 6)
        assert result["lr"][0] == result["lr"][1]
        assert result["scale"][0] == result["scale"][1]
        assert Path(result["path"]).name == "global_step3"
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    assert not [p for p in os.listdir(tmp_path / "ckpt") if p.startswith(".")]  # no staging left


def _failure_worker(save_dir: str) -> dict:
    import slipstream
    from slipstream.runtime.checkpoint import CheckpointNotFoundError, CorruptCheckpointError

    torch.manual_seed(0)
    engine, *_ = slipstream.initialize(model=DropoutNet(), config=_config("fp32"))
    messages: dict[str, str] = {}

    def expect(name: str, error: type[Exception], call) -> None:
        try:
            call()
        except error as caught:
            messages[name] = str(caught)
        else:
            messages[name] = "NO ERROR"

    root = Path(save_dir)
    expect("no_dir", CheckpointNotFoundError, lambda: engine.load_checkpoint(root / "nowhere"))
    root.mkdir()
    expect("no_latest", CheckpointNotFoundError, lambda: engine.load_checkpoint(root))
    _run_steps(engine, 0, 1)
    engine.save_checkpoint(root, tag="good")
    expect("bad_tag", CheckpointNotFoundError, lambda: engine.load_checkpoint(root, tag="missing"))
    expect("tag_name", ValueError, lambda: engine.save_checkpoint(root, tag="../escape"))

    # Truncate the optimizer file: the manifest's byte count catches it.
    engine.save_checkpoint(root, tag="truncated")
    opt = root / "truncated" / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:-7])
    expect(
        "truncated", CorruptCheckpointError, lambda: engine.load_checkpoint(root, tag="truncated")
    )

    # Garbage with the right size: the safetensors header check catches it.
    engine.save_checkpoint(root, tag="garbage")
    model_file = root / "garbage" / "model.safetensors"
    model_file.write_bytes(b"\xff" * model_file.stat().st_size)
    expect("garbage", CorruptCheckpointError, lambda: engine.load_checkpoint(root, tag="garbage"))

    # An interrupted save: a directory without manifest.
    (root / "half").mkdir()
    (root / "half" / "model.safetensors").write_bytes(b"")
    expect("no_manifest", CorruptCheckpointError, lambda: engine.load_checkpoint(root, tag="half"))

    # Another model's checkpoint.
    other, *_ = slipstream.initialize(
        model=nn.Sequential(nn.Linear(3, 3)),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    expect("wrong_model", Exception, lambda: other.load_checkpoint(root, tag="good"))

    # The good one still loads after all that.
    path, _ = engine.load_checkpoint(root, tag="good")
    messages["good"] = str(path)
    return messages


def test_bad_checkpoints_raise_clear_errors(tmp_path: Path) -> None:
    (messages,) = run_distributed(_failure_worker, 1, str(tmp_path / "ckpts"))
    assert "does not exist" in messages["no_dir"]
    assert "no 'latest' file" in messages["no_latest"]
    assert "'missing' not found" in messages["bad_tag"] and "good" in messages["bad_tag"]
    assert "not usable as a directory name" in messages["tag_name"]
    assert "truncated" in messages["truncated"] and "manifest records" in messages["truncated"]
    assert "corrupt" in messages["garbage"]
    assert "no manifest.json" in messages["no_manifest"]
    assert messages["wrong_model"] != "NO ERROR"
    assert messages["good"].endswith("good")


def _legacy_worker(save_dir: str) -> dict:
    import json

    import slipstream

    torch.manual_seed(0)
    engine, *_ = slipstream.initialize(model=DropoutNet(), config=_config("fp32"))
    _run_steps(engine, 0, 3)
    path = engine.save_checkpoint(save_dir)
    # The manifest as first released: counters inline, the schedule in lr_scheduler_file.
    manifest = json.loads((path / "manifest.json").read_text())
    parts = manifest.pop("parts")
    manifest["lr_scheduler_file"] = parts["lr_scheduler"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    engine2, *_ = slipstream.initialize(model=DropoutNet(), config=_config("fp32"))
    engine2.load_checkpoint(save_dir)
    return {"steps": engine2.global_steps, "lr": (engine.get_lr(), engine2.get_lr())}


def test_manifest_without_parts_still_loads(tmp_path: Path) -> None:
    (result,) = run_distributed(_legacy_worker, 1, str(tmp_path / "ckpt"))
    assert result["steps"] == 3
    assert result["lr"][0] == result["lr"][1]
