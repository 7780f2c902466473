"""ZeRO checkpoints: per-rank shards, resharding to other world sizes and stages, consolidation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slipstream.comm.testing import run_distributed

GLOBAL_BATCH = 8


def _engine(stage: int, seed: int):
    import slipstream
    from slipstream.zero.testing import TinyTransformer

    torch.manual_seed(seed)
    model = TinyTransformer()
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 2000,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    return engine


def _train(engine, first: int, last: int) -> list[float]:
    """Steps ``first..last-1`` on a fixed global batch; returns the global mean losses."""
    from slipstream import comm
    from slipstream.zero.testing import batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    micro = GLOBAL_BATCH // world
    losses = []
    for step in range(first, last):
        ids, labels = batch_for(step, 0, GLOBAL_BATCH)
        mine = slice(rank * micro, (rank + 1) * micro)
        loss = engine(ids[mine], labels[mine])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _first_run(root: str) -> list[float]:
    engine = _engine(stage=3, seed=0)
    _train(engine, 0, 3)
    engine.save_checkpoint(root, tag="a", client_state={"at": 3})
    return _train(engine, 3, 6)


def _second_run(root: str) -> dict:
    engine = _engine(stage=2, seed=123)
    _, client = engine.load_checkpoint(root, tag="a")
    resumed = _train(engine, 3, 6)
    engine.save_checkpoint(root, tag="b")
    return {
        "client": client,
        "resumed": resumed,
        "next": _train(engine, 6, 9),
        "steps": engine.global_steps,
    }


def _third_run(root: str) -> list[float]:
    engine = _engine(stage=3, seed=7)
    engine.load_checkpoint(root)  # `latest` is b
    losses = _train(engine, 6, 9)
    assert engine.save_16bit_model(f"{root}/export")
    engine.save_checkpoint(root, tag="c")
    return losses


def test_reshard_4_to_2_stage3_to_2_and_back(tmp_path: Path) -> None:
    root = str(tmp_path)
    uninterrupted = run_distributed(_first_run, 4, root, timeout=300)[0]
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert [f"model.rank{r}.safetensors" for r in range(4)] == [
        f for f in files if f.startswith("model.")
    ]
    second = run_distributed(_second_run, 2, root, timeout=300)[0]
    assert second["client"] == {"at": 3}
    for ours, ref in zip(second["resumed"], uninterrupted, strict=True):
        assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)), (second["resumed"], uninterrupted)
    third = run_distributed(_third_run, 4, root, timeout=300)[0]
    for ours, ref in zip(third, second["next"], strict=True):
        assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)), (third, second["next"])

    # Consolidation needs no process group: the fp32 weights load into a plain module.
    from slipstream.runtime.zero_checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from slipstream.zero.testing import TinyTransformer

    state = get_fp32_state_dict_from_zero_checkpoint(root, tag="c")
    model = TinyTransformer()
    model.load_state_dict(state)
    assert model.head.weight is model.embed.weight
    # save_16bit_model (fp32 run: the module's dtype is fp32) wrote the same weights.
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    for name, tensor in exported.items():
        assert torch.equal(tensor, state[name]), name

    # `slipstream convert`: a small size limit forces several files and an index.
    from slipstream.cli import main

    assert (
        main(
            [
                "convert",
                root,
                str(tmp_path / "hf"),
                "--tag",
                "c",
                "--max-shard-size",
                "8KB",
                "--quiet",
            ]
        )
        == 0
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    converted: dict[str, torch.Tensor] = {}
    for file in files:
        converted.update(load_file(str(tmp_path / "hf" / file)))
    assert set(converted) == set(index["weight_map"])
    for name, tensor in converted.items():
        assert torch.equal(tensor, state[name]), name
    assert "head.weight" not in converted and index["metadata"]["tied"] == {
        "head.weight": "embed.weight"
    }


def _stage0_to_zero(root: str) -> dict:
    """A stage-0 checkpoint (replicated files) loads into a ZeRO engine; the reverse refuses."""
    from slipstream.runtime.checkpoint import CheckpointError

    plain = _engine(stage=0, seed=0)
    _train(plain, 0, 2)
    plain.save_checkpoint(root, tag="plain")
    uninterrupted = _train(plain, 2, 4)
    sharded = _engine(stage=3, seed=5)
    sharded.load_checkpoint(root, tag="plain")
    resumed = _train(sharded, 2, 4)
    sharded.save_checkpoint(root, tag="zero")
    try:
        _engine(stage=0, seed=0).load_checkpoint(root, tag="zero")
        refused = ""
    except CheckpointError as error:
        refused = str(error)
    return {"uninterrupted": uninterrupted, "resumed": resumed, "refused": refused}


def test_stage0_checkpoint_loads_into_zero(tmp_path: Path) -> None:
    (result,) = run_distributed(_stage0_to_zero, 1, str(tmp_path), timeout=300)
    for ours, ref in zip(result["resumed"], result["uninterrupted"], strict=True):
        assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref))
    assert "ZeRO stage-3 checkpoint" in result["refused"]
    assert "get_fp32_state_dict_from_zero_checkpoint" in result["refused"]


def _precision_change(root: str) -> dict:
    """A bf16 ZeRO-2 checkpoint loaded into an fp32 ZeRO-2 engine and into bf16 ZeRO-3
    engines whose optimizer step writes the parameter shards or copies of them (parameters
    and optimizer on the host; the optimizer on NVMe): the loaded weights must be the
    checkpoint's fp32 masters (cast to the model's dtype), restored through the gradient
    path's ``load_state_dict``. On 2 GPUs the fp32
    ZeRO-2 engine publishes through the copy engines (``publish_transport`` "auto")."""
    import slipstream
    from slipstream import comm
    from slipstream.runtime.zero_checkpoint import get_fp32_state_dict_from_zero_checkpoint
    from slipstream.zero import GatheredParameters
    from slipstream.zero.testing import TinyTransformer, batch_for

    def build(stage: int, bf16: bool, seed: int, offload: str = ""):
        torch.manual_seed(seed)
        model = TinyTransformer()
        zero: dict = {"stage": stage, "reduce_bucket_size": 2000}
        if offload == "cpu":  # the CPU step writes the (host) parameter shards
            zero["stage3_param_persistence_threshold"] = 0
            zero["offload_param"] = {"device": "cpu"}
            zero["offload_optimizer"] = {"device": "cpu"}
        elif offload == "nvme":  # on a GPU: the step writes host staging copies of the shards
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": f"{root}/swap"}
        config = {
            "train_batch_size": GLOBAL_BATCH,
            "steps_per_print": 1000,
            "bf16": {"enabled": bf16},
            "zero_optimization": zero,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        return slipstream.initialize(model=model, optimizer=optimizer, config=config)[0]

    def train(engine, steps: range) -> None:
        world, rank = comm.get_world_size(), comm.get_rank()
        micro = GLOBAL_BATCH // world
        device = engine.device
        for step in steps:
            ids, labels = (t.to(device) for t in batch_for(step, 0, GLOBAL_BATCH))
            mine = slice(rank * micro, (rank + 1) * micro)
            engine.backward(engine(ids[mine], labels[mine]))
            engine.step()

    saved = build(2, bf16=True, seed=0)
    train(saved, range(2))
    saved.save_checkpoint(root, tag="bf16")
    masters = get_fp32_state_dict_from_zero_checkpoint(root, tag="bf16")
    result: dict = {}
    Path(f"{root}/swap").mkdir(exist_ok=True)
    for name, (stage, bf16, offload) in {
        "fp32 stage 2": (2, False, ""),
        "bf16 stage 3 offloaded": (3, True, "cpu"),
        "bf16 stage 3 nvme optimizer": (3, True, "nvme"),
    }.items():
        engine = build(stage, bf16, seed=1, offload=offload)
        train(engine, range(1))  # its weights and copies differ from the checkpoint's
        calls: list[int] = []
        load = engine.gradient_path.load_state_dict

        def counted(state: dict, load=load, calls=calls) -> None:
            calls.append(len(state["masters"]))
            load(state)

        engine.gradient_path.load_state_dict = counted
        engine.load_checkpoint(root, tag="bf16")
        params = [p for _, p in engine.module.named_parameters() if p.requires_grad]
        with GatheredParameters(params):
            wrong = [
                n
                for n, p in engine.module.named_parameters()
                if p.requires_grad and not torch.equal(p.detach().cpu(), masters[n].to(p.dtype))
            ]
        result[name] = {
            "calls": calls,
            "masters": len(engine.zero.masters.masters),
            "wrong": wrong,
            "transport": getattr(engine.gradient_path, "publish_transport", None),
        }
        train(engine, range(2, 3))  # and it trains on from there
    return result


def _check_precision_change(results: list[dict]) -> None:
    for result in results:
        for name, case in result.items():
            assert case["wrong"] == [], (name, case)
            assert case["calls"] == [case["masters"]], (name, case)


def test_loaded_weights_are_the_masters_through_the_gradient_path(tmp_path: Path) -> None:
    """Fails on a load that copies the model-dtype weights and writes the masters beside the
    path: a bf16 checkpoint's weights are not an fp32 run's, and the CPU step's host shards
    keep their old values."""
    _check_precision_change(run_distributed(_precision_change, 2, str(tmp_path), timeout=300))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_loaded_weights_are_the_masters_on_two_gpus(tmp_path: Path) -> None:
    """The same on 2 GPUs (NCCL): the fp32 ZeRO-2 engine publishes the loaded masters
    through the copy engines."""
    results = run_distributed(_precision_change, 2, str(tmp_path), backend="nccl", timeout=300)
    _check_precision_change(results)
    assert results[0]["fp32 stage 2"]["transport"] == "copy_engine", results[0]
