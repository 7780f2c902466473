"""A pipeline checkpoint resumes bit for bit, through the gradient path's ``load_state_dict``.

One spawned world of 2 gloo ranks (2 stages), ZeRO 0, 2, and 1 with the optimizer offloaded
to NVMe (a swap folder; its publish after a load must refresh the staged copies): a run saves
after step 2 and goes on to step 4; a fresh engine built from another seed loads the
checkpoint and trains steps 3-4. Its weights, optimizer state (``betas`` a tuple again), learning rate and counters
must equal the uninterrupted run's exactly, and the load must have gone through the gradient
path's ``load_state_dict`` (the checkpoint manager's one way into a path's state), with the
masters and the optimizer state handed over there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slipstream.comm.testing import run_distributed

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 32, 16, 2, 2, 24
MICRO, GAS, SEQ, STEPS, SAVE_AT = 2, 2, 8, 4, 2


def _engine(zero_stage: int, seed: int, swap: str | None = None) -> Any:
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.95]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": zero_stage},
    }
    if swap is not None:
        Path(swap).mkdir(parents=True, exist_ok=True)
        offload = {"device": "nvme", "nvme_path": swap}
        config["zero_optimization"]["offload_optimizer"] = offload  # type: ignore[index]
    torch.manual_seed(seed)
    specs = decoder_layer_specs(VOCAB, HIDDEN, LAYERS, HEADS, FFN, tie_embeddings=True)
    module = PipelineModule(specs, num_stages=2, loss_fn=language_model_loss)
    engine, *_ = initialize_pipeline(model=module, config=config)
    return engine


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(10 * step)
    return [
        (
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen),
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen),
        )
        for _ in range(GAS)
    ]


def _snapshot(engine: Any) -> dict[str, Any]:
    state = [
        (key, value.detach().clone() if isinstance(value, torch.Tensor) else value)
        for per_param in engine.optimizer.state.values()
        for key, value in sorted(per_param.items())
    ]
    return {
        "params": [p.detach().clone() for p in engine.module.parameters()],
        "state": state,
        "lr": engine.get_lr(),
        "steps": (engine.global_steps, engine.global_samples, engine.skipped_steps),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _worker(root: str) -> list[str]:
    problems: list[str] = []
    for zero_stage, nvme in ((0, False), (2, False), (1, True)):
        name = f"zero {zero_stage}{' nvme' if nvme else ''}"
        folder = Path(root) / name.replace(" ", "_")
        swap = str(folder) + "_swap" if nvme else None
        whole = _engine(zero_stage, seed=0, swap=swap and swap + "_whole")
        for step in range(STEPS):
            if step == SAVE_AT:
                whole.save_checkpoint(folder)
            whole.train_batch(iter(_batches(step)))
        # Other weights: only the checkpoint restores them.
        resumed = _engine(zero_stage, seed=1, swap=swap and swap + "_resumed")
        path = resumed.gradient_path
        handed: list[dict[str, Any]] = []
        load_state_dict = path.load_state_dict

        def spy(state: dict[str, Any], load: Any = load_state_dict, seen: list = handed) -> None:
            seen.append(state)
            load(state)

        path.load_state_dict = spy
        resumed.load_checkpoint(folder)
        if len(handed) != 1:
            problems.append(f"{name}: the path's load_state_dict ran {len(handed)} times")
        elif not handed[0].get("optimizer") or (zero_stage > 0) != bool(handed[0]["masters"]):
            problems.append(f"{name}: the path was not handed the masters and optimizer state")
        betas = resumed.optimizer.param_groups[0]["betas"]
        if not isinstance(betas, tuple):
            problems.append(f"{name}: betas came back as {type(betas).__name__}")
        for step in range(SAVE_AT, STEPS):
            resumed.train_batch(iter(_batches(step)))
        expected, got = _snapshot(whole), _snapshot(resumed)
        for key in expected:
            if not _same(expected[key], got[key]):
                problems.append(f"{name}: {key} differ from the uninterrupted run's")
    return problems


def test_pipeline_resume_is_exact_through_the_gradient_path(tmp_path: Path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=300)
    problems = [f"rank {r}: {p}" for r, found in enumerate(results) for p in found]
    assert not problems, "\n".join(problems)
