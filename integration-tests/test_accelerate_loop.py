"""An Accelerate loop on SlipstreamAccelerator: parity with plain PyTorch, save/load state.

Two gloo ranks; ZeRO-2 and ZeRO-3 (checkpointed half-way and resumed) in one spawned world. The loop is Accelerate's documented
one (``prepare``, ``accumulate``, ``backward``, ``optimizer.step``, ``scheduler.step``).
In the same world: with a fused optimizer (the skip decided on the device),
``accelerator.backward`` reads no tensor on the host from the engine's step on, and
``optimizer.step_was_skipped`` still tells the poisoned step when asked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from slipstream.comm.testing import run_distributed

pytestmark = pytest.mark.slow

GAS = 2
MICRO = 2
SAMPLES = 16  # 8 micro-batches: 2 optimizer steps per epoch on 2 ranks


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, 8, generator=generator), torch.randn(
        SAMPLES, 1, generator=generator
    )


def _schedule(step: int) -> float:
    return 1.0 / (1 + step)


def _reference(epochs: int) -> dict[str, torch.Tensor]:
    """One process: each step averages the 4 micro-batches the 2 ranks × GAS 2 see."""
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    x, y = _data()
    per_step = MICRO * GAS * 2
    for _ in range(epochs):
        for start in range(0, SAMPLES, per_step):
            losses = [
                torch.nn.functional.mse_loss(model(x[i : i + MICRO]), y[i : i + MICRO])
                for i in range(start, start + per_step, MICRO)
            ]
            (sum(losses) / len(losses)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(stage: int, epochs: int, seed: int, save: str | None, load: str | None) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from slipstream.integrations.accelerate import SlipstreamAccelerator

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
    }
    accelerator = SlipstreamAccelerator(config=config, cpu=True, gradient_accumulation_steps=GAS)
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    loader = DataLoader(TensorDataset(*_data()), batch_size=MICRO, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if load is not None:
        accelerator.load_state(load)
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    if save is not None:
        accelerator.save_state(save)
    state = accelerator.get_state_dict(model)
    return {"state": state, "steps": model.global_steps, "lr": model.get_lr()}


_READS = ("item", "__bool__", "__float__", "__int__", "tolist")


def _lazy_skip_answer() -> dict:
    """Four steps (GAS 2) with a fused AdamW, rank 1's loss poisoned at step 2. Counts every
    Python-level host read of a tensor (each a device sync on a GPU) from the start of each
    boundary's ``engine.step()`` to the end of ``accelerator.backward``; asks
    ``step_was_skipped`` after steps 0, 2 and 3 only."""
    import torch.distributed as dist

    from slipstream.integrations.accelerate import SlipstreamAccelerator

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0}
    accelerator = SlipstreamAccelerator(config=config, cpu=True, gradient_accumulation_steps=GAS)
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    counting, reads = [False], [0]
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str):
        def read(self, *args, **kwargs):
            reads[0] += counting[0]
            return originals[name](self, *args, **kwargs)

        return read

    engine_step = model.step

    def step(*args, **kwargs):
        counting[0] = accelerator.sync_gradients  # from a boundary's step to backward's end
        return engine_step(*args, **kwargs)

    model.step = step
    x, y = _data()
    answers = {}
    for index in range(4):
        for micro in range(GAS):
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x[:MICRO]), y[:MICRO])
                if index == 2 and micro == GAS - 1 and dist.get_rank() == 1:
                    loss = loss + torch.sqrt(next(model.parameters()).sum() * 0.0)  # inf grad
                for name in _READS:
                    setattr(torch.Tensor, name, counted(name))
                try:
                    accelerator.backward(loss)
                finally:
                    counting[0] = False
                    for name, original in originals.items():
                        setattr(torch.Tensor, name, original)
                optimizer.step()
                optimizer.zero_grad()
        if index != 1:
            answers[index] = optimizer.step_was_skipped
    return {"reads": reads[0], "answers": answers, "skipped": model.skipped_steps}


def _worker(root: str) -> dict:
    results: dict = {"lazy": _lazy_skip_answer()}
    results[2] = (_train(2, epochs=2, seed=0, save=None, load=None), None, None)
    full = _train(3, epochs=2, seed=0, save=None, load=None)
    first = _train(3, epochs=1, seed=0, save=f"{root}/stage3", load=None)
    # A different initial model: everything must come from the checkpoint.
    resumed = _train(3, epochs=1, seed=5, save=None, load=f"{root}/stage3")
    results[3] = (full, first, resumed)
    return results


def test_accelerate_loop_matches_pytorch_and_resumes(tmp_path: Path) -> None:
    reference = _reference(epochs=2)
    ranks = run_distributed(_worker, 2, str(tmp_path), timeout=300.0)
    for rank in ranks:
        assert rank["lazy"] == {"reads": 0, "answers": {0: False, 2: True, 3: False}, "skipped": 1}
    for stage in (2, 3):
        full, first, resumed = ranks[0][stage]
        assert full["steps"] == 4
        for name, expected in reference.items():
            torch.testing.assert_close(full["state"][name], expected, rtol=1e-5, atol=1e-6)
        if resumed is not None:  # ZeRO-3: resuming reproduces the uninterrupted run exactly
            assert first["steps"] == 2 and resumed["lr"] == full["lr"]
            for name, value in full["state"].items():
                torch.testing.assert_close(resumed["state"][name], value, rtol=0, atol=0)
        for name, value in ranks[1][stage][0]["state"].items():
            torch.testing.assert_close(value, full["state"][name], rtol=0, atol=0)
