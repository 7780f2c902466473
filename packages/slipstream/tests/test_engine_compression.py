"""The engine with slipstream.compression: QAT and gradual pruning inside the initialize loop,
step for step equal to a plain loop that drives the CompressionScheduler itself."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.comm.testing import run_distributed
from slipstream.kernels.config_schema import ConfigError

COMPRESSION: dict[str, Any] = {
    "weight_quantization": {
        "shared_parameters": {"enabled": True, "schedule_offset": 2, "quantize_groups": 4},
        "different_groups": {
            "wq1": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 2}}
        },
    },
    "sparse_pruning": {
        "shared_parameters": {"enabled": True, "schedule_offset": 3, "method": "l1"},
        "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["^1$"]}},
    },
}


class Net(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return F.mse_loss(super().forward(x), y)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _qat_worker(save_dir: str) -> dict[str, Any]:
    import slipstream
    from slipstream.compression import CompressionScheduler, init_compression

    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    config = {
        "train_batch_size": 4 * world,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "compression_training": COMPRESSION,
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    init_compression(reference, config)
    scheduler = CompressionScheduler(reference, config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    losses, expected, bits = [], [], []
    for step in range(8):
        x, y = _data(step)  # the same batch on every rank: the mean gradient is the local one
        bits.append(engine.module[0].weight_bits)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_loss = reference(x, y)
        optimizer.zero_grad()
        ref_loss.backward()
        optimizer.step()
        scheduler.step()
        expected.append(ref_loss.item())
    zeros = float((engine.module[1].compressed_weight()[0] == 0).float().mean())
    # The scheduler's step count travels with the checkpoint: a resumed run quantizes alike.
    engine.save_checkpoint(save_dir, tag="qat")
    resumed, *_ = slipstream.initialize(model=Net(), config=config)
    resumed.load_checkpoint(save_dir, tag="qat")
    x, y = _data(8)
    same = torch.allclose(resumed(x, y), engine(x, y))
    return {
        "losses": losses,
        "expected": expected,
        "bits": bits,
        "zeros": zeros,
        "resumed_steps": resumed.compression_scheduler.training_steps,
        "resumed_bits": resumed.module[0].weight_bits,
        "resumed_same_loss": same,
    }


def test_qat_and_pruning_follow_the_engine_steps(tmp_path: Path) -> None:
    for result in run_distributed(_qat_worker, 2, str(tmp_path)):
        assert result["bits"] == [None, None, 8, 8, 7, 7, 6, 6]
        assert result["resumed_steps"] == 8 and result["resumed_bits"] == 5
        assert result["resumed_same_loss"]
        assert result["zeros"] == pytest.approx(0.5)
        torch.testing.assert_close(result["losses"], result["expected"], rtol=1e-5, atol=1e-6)


def test_the_umbrella_config_validates_the_block() -> None:
    from slipstream.config import load_config

    config = load_config({"train_batch_size": 1, "compression_training": COMPRESSION}, world_size=1)
    assert config.compression_training.weight_quantization.shared_parameters.schedule_offset == 2
    with pytest.raises(ConfigError, match=r"compression_training.sparse_pruning.shared_parameters"):
        load_config(
            {
                "train_batch_size": 1,
                "compression_training": {"sparse_pruning": {"shared_parameters": {"methd": 1}}},
            },
            world_size=1,
        )
