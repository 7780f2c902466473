"""Lightning's Trainer with SlipstreamStrategy: parity with plain PyTorch, checkpoint and resume.

Two gloo ranks; ZeRO-2 (by its registered name) and ZeRO-3 (by the class, checkpointed and
resumed) in one spawned world; ``accumulate_grad_batches=2`` and ``gradient_clip_val`` go to
the engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from slipstream.comm.testing import run_distributed

pytestmark = pytest.mark.slow

SAMPLES = 16  # per epoch: 4 micro-batches of 2 per rank = 2 optimizer steps (GAS 2)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 8, generator=generator), torch.randn(
        SAMPLES, 1, generator=generator
    )


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _reference(epochs: int) -> dict[str, torch.Tensor]:
    net = _net(0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x, y = _data()
    for _ in range(epochs):
        for start in range(0, SAMPLES, 8):  # 2 ranks × GAS 2 × micro-batch 2
            loss = torch.nn.functional.mse_loss(net(x[start : start + 8]), y[start : start + 8])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


def _fit(strategy: object, seed: int, epochs: int, save: str | None, resume: str | None) -> dict:
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net(seed)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # Lightning's would shuffle; the reference needs the order
    )
    module = Regression()
    dataset = TensorDataset(*_data())
    sampler = DistributedSampler(dataset, num_replicas=2, rank=dist.get_rank(), shuffle=False)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    engine = trainer.strategy.engine
    from slipstream.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"state": state, "steps": engine.global_steps, "epoch": trainer.current_epoch}


def _worker(root: str) -> dict:
    from slipstream.integrations.lightning import SlipstreamStrategy

    results = {}
    for stage in (2, 3):
        # By name for ZeRO-2, by class for ZeRO-3 (fresh objects each fit).
        make = (
            (lambda: "slipstream_stage_2") if stage == 2 else (lambda: SlipstreamStrategy(stage=3))
        )
        full = _fit(make(), seed=0, epochs=2, save=None, resume=None)
        _fit(make(), seed=0, epochs=1, save=f"{root}/stage{stage}", resume=None)
        resumed = _fit(make(), seed=7, epochs=2, save=None, resume=f"{root}/stage{stage}")
        results[stage] = (full, resumed)
    return results


def test_slipstream_strategy_matches_pytorch_and_resumes(tmp_path: Path) -> None:
    reference = _reference(epochs=2)
    ranks = run_distributed(_worker, 2, str(tmp_path), timeout=300.0)
    for stage in (2, 3):
        full, resumed = ranks[0][stage]
        assert full["steps"] == 4
        for name, expected in reference.items():
            torch.testing.assert_close(full["state"][name], expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ranks[1][stage][0]["state"][name], full["state"][name])
            if resumed is not None:
                assert resumed["steps"] == 4
                torch.testing.assert_close(
                    resumed["state"][name], full["state"][name], rtol=0, atol=0
                )
