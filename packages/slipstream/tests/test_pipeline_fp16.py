"""fp16 with pipelines: one loss scale and one overflow vote for every stage.

One spawned run on 4 gloo ranks (PP=2 × DP=2), at ZeRO stage 0 and 1:

- fp16 (autocast, dynamic loss scale) at a moderate scale trains like fp32 within fp16's
  rounding (losses within 2%);
- at a loss scale of 2^20 the first steps overflow: every rank of every stage skips them
  alike (weights unchanged everywhere, the same skipped count and loss scale on every rank),
  the scale backs off and training goes on;
- fp32 with ``check_grad_overflow``: an inf put into one last-stage gradient makes the first
  stage skip the step too, and the learning-rate schedule does not advance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from slipstream.comm.testing import run_distributed

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 32, 16, 2, 2, 24
MICRO, GAS, SEQ, STEPS = 2, 2, 8, 3


def _engine(zero_stage, **extra):
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import decoder_layer_specs, language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": zero_stage},
        **extra,
    }
    specs = decoder_layer_specs(VOCAB, HIDDEN, LAYERS, HEADS, FFN, tie_embeddings=True)
    module = PipelineModule(specs, num_stages=2, loss_fn=language_model_loss, seed_layers=True)
    engine, *_ = initialize_pipeline(model=module, config=config)
    return engine


def _batches(step, replica):
    gen = torch.Generator().manual_seed(10 * step + replica)
    return [
        (
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen),
            torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen),
        )
        for _ in range(GAS)
    ]


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _run():
    out = {}
    for zero_stage in (0, 1):
        if zero_stage == 0:  # the precision does not depend on the ZeRO stage
            runs = {}
            for name, extra in (
                ("fp32", {}),
                ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 8}}),
            ):
                engine = _engine(zero_stage, **extra)
                replica = engine.grid.data_parallel_id
                runs[name] = [
                    engine.train_batch(iter(_batches(s, replica))).item() for s in range(STEPS)
                ]
            out["fp16_vs_fp32"] = max(
                abs(a - b) / abs(b) for a, b in zip(runs["fp16"], runs["fp32"])
            )
        # Overflow at 2^20: every rank skips alike, weights unchanged, then training resumes.
        engine = _engine(
            zero_stage, fp16={"enabled": True, "initial_scale_power": 20, "hysteresis": 1}
        )
        replica = engine.grid.data_parallel_id
        before = _params(engine)
        first = engine.train_batch(iter(_batches(0, replica))).item()
        unchanged = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
        losses = [engine.train_batch(iter(_batches(s, replica))).item() for s in range(1, 6)]
        out[(zero_stage, "overflow")] = {
            "first_unchanged": unchanged,
            "first_finite": math.isfinite(first),
            "skipped": engine.skipped_steps,
            "scale": engine.loss_scaler.loss_scale,
            "moved": any(
                not torch.equal(before[n], p) for n, p in engine.module.named_parameters()
            ),
            "finite": all(math.isfinite(v) for v in losses),
        }
        # fp32 + check_grad_overflow: an inf in one last-stage gradient skips every stage.
        engine = _engine(zero_stage, check_grad_overflow=True)
        replica = engine.grid.data_parallel_id
        engine.train_batch(iter(_batches(0, replica)))
        lr = engine.get_lr()[0]
        before = _params(engine)
        handle = None
        if engine.is_last_stage():
            weight = next(p for n, p in engine.module.named_parameters() if not n.startswith("t"))
            handle = weight.register_hook(lambda g: g * float("inf"))
        engine.train_batch(iter(_batches(1, replica)))
        if handle is not None:
            handle.remove()
        out[(zero_stage, "nonfinite")] = {
            "unchanged": all(
                torch.equal(before[n], p) for n, p in engine.module.named_parameters()
            ),
            "skipped": engine.skipped_steps,
            "lr_kept": engine.get_lr()[0] == lr,
            "stage": engine.module.stage_id,
        }
        dist.barrier()
    return out


def test_fp16_pipeline_shares_loss_scale_and_overflow_vote():
    reports = run_distributed(_run, 4, timeout=300)
    for zero_stage in (0, 1):
        for rank, report in enumerate(reports):
            where = (zero_stage, rank)
            assert report["fp16_vs_fp32"] < 2e-2, where
            overflow = report[(zero_stage, "overflow")]
            assert overflow["first_unchanged"] and overflow["first_finite"], where
            assert overflow["skipped"] >= 1 and overflow["scale"] < 2.0**20, where
            assert overflow["moved"] and overflow["finite"], where
            assert overflow == reports[0][(zero_stage, "overflow")], where  # every rank alike
            nonfinite = report[(zero_stage, "nonfinite")]
            assert nonfinite["unchanged"] and nonfinite["skipped"] == 1, (where, nonfinite)
            assert nonfinite["lr_kept"], where
        assert {r[(zero_stage, "nonfinite")]["stage"] for r in reports} == {0, 1}
