"""Pipelines decide the non-finite skip on the device: the gradient path's step reads nothing.

With a fused optimizer (``found_inf`` in its kernels) the pipeline engine steps without
asking the host whether the step is skipped, as the plain engine does; the flag is read
later (before the next update, at the next fp16 batch, or by the counters). Counted on CPU
by wrapping every Python-level host read of a tensor (``item``, ``bool``, ``float``, ``int``,
``tolist``) while the gradient path's ``step`` runs; the same run with a non-fused optimizer
must read (so the counter would catch a read that comes back).

One spawned world of 2 gloo ranks (2 stages), ZeRO 0 and 1: an inf put into one last-stage
gradient at step 1 skips every stage; fp32 runs then match, bit for bit, a twin that never
saw that batch (the learning-rate schedule held back too); fp16's scale backs off.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest
import torch

from slipstream.comm.testing import run_distributed

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 32, 16, 2, 2, 24
MICRO, GAS, SEQ, STEPS, BAD = 2, 2, 8, 4, 1
_READS = ("item", "__bool__", "__float__", "__int__", "tolist")


@contextmanager
def _count_host_reads(counter: list[int]) -> Any:
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name: str) -> Any:
        original = originals[name]

        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in _READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _engine(zero_stage: int, fused: bool, extra: dict) -> Any:
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": zero_stage},
        **extra,
    }
    specs = decoder_layer_specs(VOCAB, HIDDEN, LAYERS, HEADS, FFN, tie_embeddings=True)
    module = PipelineModule(specs, num_stages=2, loss_fn=language_model_loss, seed_layers=True)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, fused=fused)
    engine, *_ = initialize_pipeline(model=module, config=config, optimizer=optimizer)
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


def _params(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _case(zero_stage: int, fused: bool, fp16: bool) -> list[str]:
    name = f"zero {zero_stage} {'fused' if fused else 'foreach'} {'fp16' if fp16 else 'fp32'}"
    extra: dict = {"check_grad_overflow": True}
    if fp16:
        extra = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine, twin = _engine(zero_stage, fused, extra), _engine(zero_stage, fused, extra)
    reads = [0]
    path_step = engine.gradient_path.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        with _count_host_reads(reads):
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
        handle = None
        if engine.is_last_stage():
            weight = next(p for n, p in engine.module.named_parameters() if not n.startswith("t"))
            handle = weight.register_hook(lambda g: g * float("inf"))
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


def _worker() -> list[str]:
    problems: list[str] = []
    for zero_stage, fused, fp16 in ((0, True, False), (1, True, False), (0, True, True)):
        problems += _case(zero_stage, fused, fp16)
    problems += _case(0, False, False)
    return problems


def test_pipeline_skip_is_decided_on_the_device() -> None:
    results = run_distributed(_worker, 2, timeout=300)
    problems = [f"rank {r}: {p}" for r, found in enumerate(results) for p in found]
    assert not problems, "\n".join(problems)


def _no_sync_worker() -> list[str]:
    """bf16, AdamW from the config (fused on CUDA), clipping, the default non-finite check,
    ZeRO 0 and 1: the gradient path's ``step`` under ``torch.cuda.set_sync_debug_mode("error")``
    on every batch, a poisoned batch among them still skipped exactly."""
    import traceback

    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    problems: list[str] = []
    for zero_stage in (0, 1):
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": GAS,
            "gradient_clipping": 1.0,
            "steps_per_print": 10_000,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": zero_stage},
        }
        specs = decoder_layer_specs(VOCAB, HIDDEN, LAYERS, HEADS, FFN, tie_embeddings=True)
        module = PipelineModule(specs, num_stages=2, loss_fn=language_model_loss)
        engine, *_ = initialize_pipeline(model=module, config=config)
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
            batches = [(x.cuda(), y.cuda()) for x, y in _batches(step)]
            before = _params(engine) if step == BAD else None
            handle = None
            if step == BAD and engine.is_last_stage():
                weight = next(p for n, p in engine.module.named_parameters() if n[0] != "t")
                handle = weight.register_hook(lambda g: g * float("inf"))
            try:
                engine.train_batch(iter(batches))
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
