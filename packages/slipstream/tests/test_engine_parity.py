"""Stage-0 engine vs plain PyTorch DDP, step by step, on CPU with gloo."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slipstream.comm.testing import run_distributed

IN, HIDDEN, OUT = 12, 24, 5


class TinyNet(nn.Module):
    """Two layers, a shared (used-twice) layer and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.shared = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT)
        self.frozen = nn.Parameter(torch.ones(HIDDEN), requires_grad=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) * self.frozen
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))  # the same weights twice
        return F.cross_entropy(self.out(h), y)


def _batch(step: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(size, IN, generator=g), torch.randint(0, OUT, (size,), generator=g)


def _rel_diff(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for p, q in zip(a.parameters(), b.parameters()):
        denom = q.detach().abs().max().clamp_min(1e-12)
        worst = max(worst, float((p.detach().float() - q.detach().float()).abs().max() / denom))
    return worst


def _engine_vs_ddp(steps: int, micro: int, gas: int, config_extra: dict) -> dict:
    """Train the engine and a DDP reference on identical data; return per-step differences."""
    import slipstream
    from slipstream import comm

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyNet()
    reference = copy.deepcopy(model)
    lr, wd, clip = 0.05, 0.01, 0.5
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
        **config_extra,
    }
    engine, _, _, _ = slipstream.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    ddp = DistributedDataParallel(reference)
    ref_opt = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=lr, weight_decay=wd
    )

    diffs, losses, ref_losses = [], [], []
    for step in range(steps):
        for m in range(gas):
            x, y = _batch(step, m, micro * world)
            x, y = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))

            if m < gas - 1:
                with ddp.no_sync():
                    ref_loss = ddp(x, y)
                    (ref_loss / gas).backward()
            else:
                ref_loss = ddp(x, y)
                (ref_loss / gas).backward()
            ref_losses.append(float(ref_loss))
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(_rel_diff(engine.module, reference))
    return {
        "diffs": diffs,
        "losses": losses,
        "ref_losses": ref_losses,
        "global_steps": engine.global_steps,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_stage0_matches_ddp_fp32(world_size: int) -> None:
    results = run_distributed(_engine_vs_ddp, world_size, 5, 2, 3, {})
    for rank_result in results:
        assert rank_result["global_steps"] == 5
        assert max(rank_result["diffs"]) <= 1e-6, rank_result["diffs"]
        for ours, ref in zip(rank_result["losses"], rank_result["ref_losses"]):
            assert abs(ours - ref) <= 1e-6 * max(1.0, abs(ref))


def test_stage0_matches_ddp_with_prescale_and_small_buckets() -> None:
    extra = {
        "prescale_gradients": True,
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 100},  # many buckets
    }
    results = run_distributed(_engine_vs_ddp, 2, 4, 2, 2, extra)
    for rank_result in results:
        assert max(rank_result["diffs"]) <= 1e-6, rank_result["diffs"]


def _gas_equivalence() -> dict:
    """GAS 4 × micro 2 against GAS 1 × micro 8 on the same 8 samples per step."""
    import slipstream

    outcomes = {}
    for micro, gas in ((2, 4), (8, 1)):
        torch.manual_seed(0)
        model = TinyNet()
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        }
        engine, _, _, _ = slipstream.initialize(model=model, config=config)
        for step in range(4):
            x, y = _batch(step, 0, 8)
            for m in range(gas):
                engine.backward(
                    engine(x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro])
                )
                engine.step()
        outcomes[gas] = [p.detach().clone() for p in engine.module.parameters()]
    worst = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        for a, b in zip(outcomes[4], outcomes[1])
    )
    return {"worst": worst}


def test_gradient_accumulation_matches_large_micro_batch() -> None:
    (result,) = run_distributed(_gas_equivalence, 1)
    assert result["worst"] <= 1e-6
