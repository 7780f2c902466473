"""The pipeline engine on its gradient path: the skip decided on the device, exact resumes.

One spawned world of 2 gloo ranks (2 stages) runs both checks:

- **The skip on the device.** With a fused optimizer (``found_inf`` in its kernels) the
  engine steps without asking the host whether the step is skipped, as the plain engine does;
  the flag is read later (before the next update, at the next fp16 batch, or by the
  counters). Host reads of tensors are counted while the gradient path's ``step`` runs
  (:func:`slipstream.comm.testing.count_host_reads`); the same run with a non-fused optimizer
  must read (so the counter would catch a read that comes back). ZeRO 0 and 1: an inf put
  into one last-stage gradient at step 1 skips every stage; fp32 runs then match, bit for
  bit, a twin that never saw that batch (the learning-rate schedule held back too); fp16's
  scale backs off.
- **Exact resumes through the path.** ZeRO 0, 2, and 1 with the optimizer offloaded to NVMe
  (a swap folder; its publish after a load must refresh the staged copies): a run saves after
  step 2 and goes on to step 4; a fresh engine built from another seed loads the checkpoint
  and trains steps 3-4. Its weights, optimizer state (``betas`` a tuple again), learning rate
  and counters must equal the uninterrupted run's exactly, and the load must have gone
  through the gradient path's ``load_state_dict`` (the checkpoint manager's one way into a
  path's state), with the masters and the optimizer state handed over there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.comm.testing import count_host_reads, run_distributed

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 32, 16, 2, 2, 24
MICRO, GAS, SEQ, STEPS, BAD, SAVE_AT = 2, 2, 8, 4, 1, 2


def _engine(zero_stage: int, *, seed: int = 0, fused: bool | None = None, **extra: Any) -> Any:
    """A 2-stage decoder on the pipeline engine. ``fused``: the user's AdamW, fused or not
    (None: the config's AdamW, betas (0.8, 0.95)); ``extra``: more config keys."""
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.5,
        "steps_per_print": 10_000,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "zero_optimization": {"stage": zero_stage},
        **extra,
    }
    optimizer = None
    torch.manual_seed(seed)
    specs = decoder_layer_specs(VOCAB, HIDDEN, LAYERS, HEADS, FFN, tie_embeddings=True)
    module = PipelineModule(specs, num_stages=2, loss_fn=language_model_loss)
    if fused is None:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.95]}}
    else:
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=fused)
    engine, *_ = initialize_pipeline(model=module, config=config, optimizer=optimizer)
    return engine


def _batches(step: int, device: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(10 * step)
    return [
        (
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen).to(device),
        )
        for _ in range(GAS)
    ]


def _params(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _poison(engine: Any) -> Any:
    """An inf in one last-stage weight's gradient (a hook handle to remove; None elsewhere)."""
    if not engine.is_last_stage():
        return None
    weight = next(p for n, p in engine.module.named_parameters() if not n.startswith("t"))
    return weight.register_hook(lambda g: g * float("inf"))


# ---------------------------------------------------------------------------- the skip
def _skip_case(zero_stage: int, fused: bool, fp16: bool) -> list[str]:
    name = f"zero {zero_stage} {'fused' if fused else 'foreach'} {'fp16' if fp16 else 'fp32'}"
    extra: dict = {"check_grad_overflow": True}
    if fp16:
        extra = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine = _engine(zero_stage, fused=fused, **extra)
    twin = _engine(zero_stage, fused=fused, **extra)
    reads = [0]
    path_step = engine.gradient_path.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        with count_host_reads(reads):
            return path_step(*args, **kwargs)

    engine.gradient_path.step = counted_step
    problems = []
    for step in range(STEPS):
        if step != BAD:
            engine.train_batch(iter(_batches(step)))
            twin.train_batch(iter(_batches(step)))
            continue
        before, lr, scale = _params(engine), engine.get_lr(), engine.loss_scaler
        scale_before = scale.loss_scale if scale is not None else None
        handle = _poison(engine)
        engine.train_batch(iter(_batches(step)))
        if handle is not None:
            handle.remove()
        if not all(torch.equal(b, a) for b, a in zip(before, _params(engine))):
            problems.append(f"{name}: the skipped step changed the weights")
        if engine.skipped_steps != 1:
            problems.append(f"{name}: skipped_steps {engine.skipped_steps} after the bad step")
        if engine.get_lr() != lr:
            problems.append(f"{name}: the schedule moved on a skipped step")
        if scale is not None and scale.loss_scale != scale_before / 2:
            problems.append(f"{name}: loss scale {scale_before} -> {scale.loss_scale}")
    if fused and reads[0]:
        problems.append(f"{name}: the path's step read a tensor on the host {reads[0]} times")
    if not fused and not reads[0]:
        problems.append(f"{name}: the non-fused step read nothing (the counter is broken)")
    if engine.skipped_steps != 1 or twin.skipped_steps != 0:
        problems.append(f"{name}: skipped {engine.skipped_steps}, twin {twin.skipped_steps}")
    if not fp16:  # fp16's scales differ after the back-off; fp32 must be exact
        if not all(torch.equal(a, b) for a, b in zip(_params(engine), _params(twin))):
            problems.append(f"{name}: differs from the twin that never saw the bad batch")
        if engine.get_lr() != twin.get_lr():
            problems.append(f"{name}: lr {engine.get_lr()} vs twin {twin.get_lr()}")
    return problems


# ---------------------------------------------------------------------------- resumes
def _snapshot(engine: Any) -> dict[str, Any]:
    state = [
        (key, value.detach().clone() if isinstance(value, torch.Tensor) else value)
        for per_param in engine.optimizer.state.values()
        for key, value in sorted(per_param.items())
    ]
    return {
        "params": _params(engine),
        "state": state,
        "lr": engine.get_lr(),
        "steps": (engine.global_steps, engine.global_samples, engine.skipped_steps),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _nvme(swap: str) -> dict[str, Any]:
    Path(swap).mkdir(parents=True, exist_ok=True)
    return {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": swap}}


def _resume_case(root: Path, zero_stage: int, nvme: bool) -> list[str]:
    name = f"zero {zero_stage}{' nvme' if nvme else ''}"
    folder = root / name.replace(" ", "_")
    whole = _engine(
        zero_stage, **({"zero_optimization": _nvme(f"{folder}_swap_whole")} if nvme else {})
    )
    for step in range(STEPS):
        if step == SAVE_AT:
            whole.save_checkpoint(folder)
        whole.train_batch(iter(_batches(step)))
    # Another seed: only the checkpoint can make the weights equal.
    resumed = _engine(
        zero_stage,
        seed=1,
        **({"zero_optimization": _nvme(f"{folder}_swap_resumed")} if nvme else {}),
    )
    path = resumed.gradient_path
    handed: list[dict[str, Any]] = []
    load_state_dict = path.load_state_dict

    def spy(state: dict[str, Any], load: Any = load_state_dict, seen: list = handed) -> None:
        seen.append(state)
        load(state)

    path.load_state_dict = spy
    resumed.load_checkpoint(folder)
    problems = []
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


def _worker(root: str) -> list[str]:
    problems: list[str] = []
    for zero_stage, fused, fp16 in ((0, True, False), (1, True, False), (0, True, True)):
        problems += _skip_case(zero_stage, fused, fp16)
    problems += _skip_case(0, False, False)
    for zero_stage, nvme in ((0, False), (2, False), (1, True)):
        problems += _resume_case(Path(root), zero_stage, nvme)
    return problems


def test_pipeline_skips_on_the_device_and_resumes_through_the_path(tmp_path: Path) -> None:
    results = run_distributed(_worker, 2, str(tmp_path), timeout=300)
    problems = [f"rank {r}: {p}" for r, found in enumerate(results) for p in found]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- GPUs
def _no_sync_worker() -> list[str]:
    """bf16, AdamW from the config (fused on CUDA), clipping, the default non-finite check,
    ZeRO 0 and 1: the gradient path's ``step`` under ``torch.cuda.set_sync_debug_mode("error")``
    on every batch, a poisoned batch among them still skipped exactly."""
    import traceback

    problems: list[str] = []
    device = torch.device("cuda", torch.cuda.current_device())
    for zero_stage in (0, 1):
        engine = _engine(zero_stage, bf16={"enabled": True})
        path_step = engine.gradient_path.step

        def strict_step(*args: Any, step: Any = path_step, **kwargs: Any) -> Any:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                return step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        engine.gradient_path.step = strict_step
        for step in range(STEPS):
            before = _params(engine) if step == BAD else None
            handle = _poison(engine) if step == BAD else None
            try:
                engine.train_batch(iter(_batches(step, device)))
            except RuntimeError as error:
                where = traceback.extract_tb(error.__traceback__)[-1]
                problems.append(
                    f"zero {zero_stage} step {step}: {str(error).splitlines()[0]} at "
                    f"{where.filename.rsplit('/src/', 1)[-1]}:{where.lineno}"
                )
                break
            finally:
                if handle is not None:
                    handle.remove()
            if before is not None and not all(
                torch.equal(b, a) for b, a in zip(before, _params(engine))
            ):
                problems.append(f"zero {zero_stage}: the skipped step changed the weights")
        if engine.skipped_steps != 1:
            problems.append(f"zero {zero_stage}: skipped_steps {engine.skipped_steps}")
    return problems


@pytest.mark.gpu
def test_pipeline_step_does_not_synchronize_on_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_distributed(_no_sync_worker, 2, backend="nccl", timeout=300)
    problems = [f"rank {r}: {p}" for r, found in enumerate(results) for p in found]
    assert not problems, "\n".join(problems)
