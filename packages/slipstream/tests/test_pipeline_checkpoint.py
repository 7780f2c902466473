"""Pipeline checkpoints saved at one layout and resumed at another give the uninterrupted losses.

One spawned run on 4 gloo ranks. The global batch is the same 8 sequences whatever the layout
(micro-batch 1, GAS = 8 / DP), so every layout computes the same losses up to the order of
fp32 sums. An uninterrupted PP=2 × DP=2 ZeRO-1 run saves after step 2; the checkpoint is
resumed at PP=1 × DP=4 ZeRO-2 and at PP=4 × DP=1 stage 0, which saves again after step 3 for
PP=2 × DP=2 stage 0 to resume; every resumed step's loss and learning rate must equal the
uninterrupted run's. Also: a missing shard and a damaged one raise named errors on every rank,
and ``slipstream convert``'s output loads into the plain (unpipelined) model and equals the
engine's weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from slipstream.comm.testing import run_distributed

pytestmark = pytest.mark.slow

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 32, 16, 4, 2, 24
SAMPLES, SEQ, STEPS, LR, CLIP = 8, 8, 4, 1e-2, 0.5


def _specs():
    from slipstream.pipeline.models import decoder_layer_specs

    return decoder_layer_specs(VOCAB, HIDDEN, LAYERS, HEADS, FFN, tie_embeddings=True)


def _batch(step, replica, dp):
    """Replica ``replica``'s micro-batches (of one sequence) of the step's global batch."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
    y = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
    gas = SAMPLES // dp
    return [(x[i : i + 1], y[i : i + 1]) for i in range(replica * gas, (replica + 1) * gas)]


def _engine(stages, zero_stage):
    from slipstream.pipeline import PipelineModule
    from slipstream.pipeline.models import language_model_loss
    from slipstream.runtime.pipeline_engine import initialize_pipeline

    dp = dist.get_world_size() // stages
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": SAMPLES // dp,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "pipeline": {"schedule": "1f1b"},
        "zero_optimization": {"stage": zero_stage, "reduce_bucket_size": 3000},
    }
    # Different seeds per layout: only the checkpoint can make the resumed weights equal.
    module = PipelineModule(
        _specs(),
        num_stages=stages,
        loss_fn=language_model_loss,
        seed_layers=True,
        base_seed=17 * stages + zero_stage,
    )
    engine, _, _, _ = initialize_pipeline(model=module, config=config)
    return engine


def _step(engine, step):
    grid = engine.grid
    dp = grid.data_parallel_size
    loss = engine.train_batch(iter(_batch(step, grid.data_parallel_id, dp))).item()
    return loss, engine.get_lr()[0]


def _plain_model_equals(converted, engine):
    """Load the converted weights into the unpipelined layers; compare with the engine's."""
    from slipstream.pipeline import TiedLayerSpec

    worst, compared = 0.0, 0
    for index, spec in enumerate(_specs()):
        if isinstance(spec, TiedLayerSpec):
            prefix = f"tied_modules.{spec.key}."
        else:
            prefix = f"{index}."
        layer = spec.build()
        layer.load_state_dict(
            {k.removeprefix(prefix): v for k, v in converted.items() if k.startswith(prefix)}
        )
        for name, value in layer.state_dict().items():
            local = dict(engine.module.named_parameters()).get(prefix + name)
            if local is not None:
                worst = max(worst, (local.detach() - value).abs().max().item())
                compared += 1
    return worst, compared


def _run(root):
    from slipstream.runtime.checkpoint import CorruptCheckpointError
    from slipstream.runtime.model_export import convert_to_hf_safetensors

    root = Path(root)
    rank = dist.get_rank()
    out = {}
    # Uninterrupted: PP=2 × DP=2, ZeRO-1; saves after step 2.
    engine = _engine(2, 1)
    out["reference"] = []
    for step in range(STEPS):
        out["reference"].append(_step(engine, step))
        if step == 1:
            engine.save_checkpoint(root / "a")
    # PP=1 × DP=4, ZeRO-2.
    engine = _engine(1, 2)
    engine.load_checkpoint(root / "a")
    out["steps_after_load"] = engine.global_steps
    out["pp1_zero2"] = [_step(engine, step) for step in range(2, STEPS)]
    # PP=4 × DP=1, stage 0; saves after step 3; then convert that checkpoint.
    engine = _engine(4, 0)
    engine.load_checkpoint(root / "a")
    out["pp4_zero0"] = [_step(engine, 2)]
    engine.save_checkpoint(root / "c")
    if rank == 0:
        convert_to_hf_safetensors(root / "c", root / "hf", progress=False)
    dist.barrier()
    from safetensors.torch import load_file

    converted = load_file(str(root / "hf" / "model.safetensors"))
    out["converted_names"] = sorted(converted)
    out["convert_diff"] = _plain_model_equals(converted, engine)
    out["pp4_zero0"].append(_step(engine, 3))
    # PP=2 × DP=2, stage 0, from the stage-0 checkpoint.
    engine = _engine(2, 0)
    engine.load_checkpoint(root / "c")
    out["pp2_zero0"] = [_step(engine, 3)]
    # A missing shard, then a damaged one: named errors on every rank, nothing loaded.
    if rank == 0:
        shutil.copytree(root / "a" / "global_step2", root / "broken" / "t")
        (root / "broken" / "t" / "model.stage1.rank1.safetensors").unlink()
        shutil.copytree(root / "a" / "global_step2", root / "damaged" / "t")
        target = root / "damaged" / "t" / "optimizer.stage0.rank0.safetensors"
        data = bytearray(target.read_bytes())
        data[-3] ^= 0xFF
        target.write_bytes(bytes(data))
    dist.barrier()
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for case in ("broken", "damaged"):
        try:
            engine.load_checkpoint(root / case, tag="t")
        except CorruptCheckpointError as error:
            out[case] = str(error)
        else:
            out[case] = None
    out["unchanged"] = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    return out


def test_pipeline_checkpoint_resumes_at_other_layouts(tmp_path):
    reports = run_distributed(_run, 4, str(tmp_path), timeout=300)
    reference = reports[0]["reference"]
    assert reference[2][0] != reference[3][0]
    for rank, report in enumerate(reports):
        assert report["reference"] == reference, rank  # every rank returns the batch's loss
        assert report["steps_after_load"] == 2
        for key, steps in (("pp1_zero2", [2, 3]), ("pp4_zero0", [2, 3]), ("pp2_zero0", [3])):
            for (loss, lr), step in zip(report[key], steps):
                ref_loss, ref_lr = reference[step]
                assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (rank, key, step, loss)
                assert lr == ref_lr, (rank, key, step)
        assert report["convert_diff"][0] == 0.0 and report["convert_diff"][1] > 0, rank
        assert "tied_modules.embed.weight" in report["converted_names"]
        assert "missing" in report["broken"] and "model.stage1.rank1" in report["broken"]
        assert "checksum" in report["damaged"], report["damaged"]
        assert report["unchanged"]
