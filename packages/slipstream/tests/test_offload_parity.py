"""ZeRO-Offload / ZeRO-Infinity through slipstream.initialize vs the same run without offload."""

from __future__ import annotations

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("slipstream.offload")

MICRO, GAS, STEPS, CLIP = 2, 2, 3, 0.5


def _side_by_side(stage: int, precision: str, offload: dict, optimizer_name: str) -> dict:
    """Train a stage-``stage`` engine without and with ``offload``; compare every step."""
    import slipstream
    from slipstream import comm
    from slipstream.zero import GatheredParameters
    from slipstream.zero.testing import TinyTransformer, batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    offload = dict(offload)
    clip = offload.pop("_clip", CLIP)
    gas = offload.pop("_gas", GAS)
    engines = []
    for extra in ({}, offload):
        torch.manual_seed(0)
        model = TinyTransformer(unused=True)
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "lr": 0.02}]
        if optimizer_name == "adamw":  # the C++ CPU Adam
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=0.01)
        else:  # no C++ step: torch's own step on the host masters (the plumbing, exactly)
            optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
        zero = {"stage": stage, "reduce_bucket_size": 600, "stage3_param_persistence_threshold": 0}
        zero.update(extra)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "steps_per_print": 1000,
            "zero_optimization": zero,
            # Small sub-groups: the step and the NVMe swaps walk several of them.
            "aio": {"block_size": 4096, "queue_depth": 4},
        }
        config["zero_optimization"]["sub_group_size"] = 700
        if precision.startswith("bf16"):
            config["bf16"] = {"enabled": True}
        if precision == "bf16+bf16comm":  # the gradients are reduced (and land) in bf16
            config["communication_data_type"] = "bf16"
        engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
        engines.append(engine)
    plain, offloaded = engines
    diffs, norm_diffs = [], []
    for step in range(STEPS):
        for m in range(gas):
            ids, labels = batch_for(step, m, MICRO * world)
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            for engine in engines:
                engine.backward(engine(ids[mine], labels[mine]))
                engine.step()
        worst = worst_norm = 0.0
        params = list(plain.module.parameters()) + list(offloaded.module.parameters())
        with GatheredParameters(params) if stage == 3 else _null():
            for p, q in zip(offloaded.module.parameters(), plain.module.parameters()):
                delta = p.detach().float() - q.detach().float()
                reference = q.detach().float()
                worst = max(
                    worst, float(delta.abs().max() / reference.abs().max().clamp_min(1e-12))
                )
                worst_norm = max(
                    worst_norm, float(delta.norm() / reference.norm().clamp_min(1e-12))
                )
        diffs.append(worst)
        norm_diffs.append(worst_norm)
    norms = [float(e.get_global_grad_norm()) for e in engines]
    masters_on_host = all(m.device.type == "cpu" for m in offloaded.zero.masters.masters)
    flags = list(offloaded.zero.masters.offloaded)
    host_step = offloaded.zero.optimizer.offload.host
    stepped_on_host = {id(p) for p in host_step.params}
    eager = bool(offloaded.zero.optimizer.offload.eager)
    store = offloaded._stage3.store if offloaded._stage3 is not None else None
    swapped = sum(store.is_swapped(t) for t in store.tensors()) if store is not None else -1
    return {
        "swapped": swapped,
        "diffs": diffs,
        "norm_diffs": norm_diffs,
        "norms": norms,
        "host": masters_on_host,
        "eager": eager,
        "gpu_share": host_step.gpu_share,
        "offloaded": flags,
        # Partial offload: the host step takes exactly the offloaded masters.
        "host_step_matches": stepped_on_host
        == {id(m) for m, out in zip(offloaded.zero.masters.masters, flags) if out},
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NVME_PARAMS = {"device": "nvme", "nvme_path": "TMP", "max_in_cpu": 0}

CASES = [
    (1, 2, {"offload_optimizer": {"device": "cpu"}}),
    (2, 1, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    (2, 2, {"offload_optimizer": {"device": "cpu"}}),
    (3, 1, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    (3, 2, {"offload_optimizer": {"device": "cpu"}}),
    (3, 2, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    (2, 1, {"offload_optimizer": {"device": "nvme", "nvme_path": "TMP"}}),
    (
        2,
        2,
        {
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": "TMP",
                "pipeline_read": True,
                "pipeline_write": True,
            }
        },
    ),
    (3, 2, {"offload_optimizer": {"device": "nvme", "nvme_path": "TMP"}}),
    # Several all-gather buckets: each bucket's masters step, then upload and gather while
    # the next bucket steps.
    (2, 2, {"offload_optimizer": {"device": "cpu"}, "allgather_bucket_size": 500}),
    (1, 1, {"offload_optimizer": {"device": "cpu"}, "allgather_bucket_size": 500}),
    # No clipping: each bucket steps on the CPU as it lands (overlap_step), during backward;
    # on by default, off with offload_optimizer.overlap_step false.
    (1, 2, {"offload_optimizer": {"device": "cpu"}, "_clip": 0.0}),
    (2, 2, {"offload_optimizer": {"device": "cpu"}, "_clip": 0.0}),
    (2, 2, {"offload_optimizer": {"device": "cpu", "overlap_step": False}, "_clip": 0.0}),
    # Parameter shards on NVMe (ZeRO-Infinity): read back for each gather and each step's
    # sub-group, written back after it; max_in_cpu keeps the first (small) shards resident.
    (3, 1, {"offload_optimizer": {"device": "cpu"}, "offload_param": _NVME_PARAMS}),
    (3, 2, {"offload_optimizer": {"device": "cpu"}, "offload_param": _NVME_PARAMS}),
    (
        3,
        2,
        {
            "offload_optimizer": {"device": "nvme", "nvme_path": "TMP"},
            "offload_param": {**_NVME_PARAMS, "max_in_cpu": 1000},
        },
    ),
    # Partial offload (ratio): the first parameters keep their masters and states with the
    # model and step there after backward; the rest as above (speculative step under
    # clipping with AdamW, overlap_step without clipping, the step after backward with SGD).
    (1, 2, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
    (2, 1, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
    (2, 2, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
    (2, 2, {"offload_optimizer": {"device": "cpu", "ratio": 0.7}, "allgather_bucket_size": 500}),
    (2, 2, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "_clip": 0.0}),
    (2, 2, {"offload_optimizer": {"device": "cpu", "ratio": 0.0}}),
    (3, 2, {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
    (
        3,
        2,
        {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "offload_param": {"device": "cpu"}},
    ),
    # gpu_share: half of each Adam call's elements step through StreamedAdam (here on the
    # CPU device, the same code with plain copies), the rest on the C++ step: the speculative
    # step under clipping (kept, out of place) and overlap_step without it (in place).
    (2, 1, {"offload_optimizer": {"device": "cpu", "gpu_share": 0.5}}),
    (2, 2, {"offload_optimizer": {"device": "cpu", "gpu_share": 0.5}}),
    (2, 1, {"offload_optimizer": {"device": "cpu", "gpu_share": 0.5}, "_clip": 0.0}),
]


def _ids() -> list[str]:  # unique (checked below)
    out = []
    for stage, world, extra in CASES:
        parts = [f"stage{stage}", f"w{world}"]
        parts += [f"{k.split('_')[1]}-{v['device']}" for k, v in extra.items() if k[0] != "_"
                  and isinstance(v, dict)]  # fmt: skip
        if "allgather_bucket_size" in extra:
            parts.append("gather-buckets")
        if "_clip" in extra:
            overlap = extra["offload_optimizer"].get("overlap_step", True)
            parts.append("noclip-eager" if overlap else "noclip-not-eager")
        if extra.get("offload_optimizer", {}).get("pipeline_read"):
            parts.append("pipelined")
        if extra.get("offload_param", {}).get("max_in_cpu"):
            parts.append("max-in-cpu")
        if "ratio" in extra.get("offload_optimizer", {}):
            parts.append(f"ratio{extra['offload_optimizer']['ratio']}")
        if "gpu_share" in extra.get("offload_optimizer", {}):
            parts.append(f"gpushare{extra['offload_optimizer']['gpu_share']}")
        out.append("-".join(parts))
    return out


assert len(set(_ids())) == len(CASES)

# Tolerances over 3 steps in fp32, per tensor: max |difference| / max |weight|, and
# ||difference|| / ||weight||.
# - SGD has no C++ step: the host runs torch's own update, so the offload plumbing (host
#   masters, transfers, sub-groups, NVMe swaps, publishing) must reproduce the device run to
#   1e-6 (it is in fact exact).
# - AdamW runs the C++ kernel, whose fused multiply-adds round differently from torch's
#   separate ops (an fp32 ulp or two per step); Adam's division by sqrt(v) lets those grow on
#   elements with tiny gradients: <= 1e-6 in norm, 5e-6 at the worst element.
TOLERANCE = {"sgd": (1e-6, 1e-6), "adamw": (5e-6, 1e-6)}


# gpu_share splits the C++ Adam step only (SGD steps with torch's own): no SGD case for it.
PARITY_PARAMS = [
    pytest.param(stage, world, extra, name, id=f"{case_id}-{name}")
    for (stage, world, extra), case_id in zip(CASES, _ids())
    for name in ("sgd", "adamw")
    if not (name == "sgd" and extra.get("offload_optimizer", {}).get("gpu_share"))
]


@pytest.mark.parametrize(("stage", "world", "extra", "optimizer_name"), PARITY_PARAMS)
def test_offload_matches_the_same_run_without_it_fp32(
    stage, world, extra, optimizer_name, tmp_path
) -> None:
    extra = dict(extra)  # shared by the parametrisations
    share = extra.get("offload_optimizer", {}).get("gpu_share", 0.0)
    eager = "_clip" in extra and extra.get("offload_optimizer", {}).get("overlap_step", True)
    extra = {
        key: {k: (str(tmp_path) if v == "TMP" else v) for k, v in block.items()}
        if isinstance(block, dict)
        else block
        for key, block in extra.items()
    }
    results = run_distributed(
        _side_by_side, world, stage, "fp32", extra, optimizer_name, timeout=300
    )
    ratio = extra.get("offload_optimizer", {}).get("ratio", 1.0)
    for result in results:
        flags = result["offloaded"]
        assert result["host_step_matches"]
        if ratio == 1.0:
            assert all(flags)
        else:  # a leading run of masters stays with the model, the rest is offloaded
            kept = flags.index(True) if True in flags else len(flags)
            assert kept > 0 and not any(flags[:kept]) and all(flags[kept:]), flags
            assert (ratio == 0.0) == (kept == len(flags)), flags
        assert result["host"]
        assert result["eager"] == eager
        assert result["gpu_share"] == share
        if extra.get("offload_param", {}).get("device") == "nvme":
            assert result["swapped"] > 0  # shards really were on disk between uses
        worst, in_norm = TOLERANCE[optimizer_name]
        assert max(result["diffs"]) <= worst, result["diffs"]
        assert max(result["norm_diffs"]) <= in_norm, result["norm_diffs"]
        plain_norm, offloaded_norm = result["norms"]
        assert offloaded_norm == pytest.approx(plain_norm, rel=1e-6)
    assert not any(tmp_path.glob("slipstream-*")), "swap folders must be removed at exit"


def test_offload_bf16_matches_without_offload() -> None:
    results = run_distributed(
        _side_by_side, 2, 2, "bf16", {"offload_optimizer": {"device": "cpu"}}, "adamw", timeout=300
    )
    for result in results:
        # Same fp32 masters and math; a bf16 rounding of a weight may flip: one bf16 ulp.
        assert max(result["diffs"]) <= 2**-7, result["diffs"]


def test_stage3_offload_bf16_comm_matches_without_offload() -> None:
    """The code path of the 13b bench row ``slipstream:3+cpu+bf16comm@13b/1``: ZeRO-3, the
    optimizer on the CPU, bf16 with a bf16 gradient reduction, no accumulation (the reduced
    gradients land on the host in bf16), clipping; beside the same run on the device."""
    offload = {"offload_optimizer": {"device": "cpu", "pin_memory": True}, "_gas": 1}
    results = run_distributed(_side_by_side, 2, 3, "bf16+bf16comm", offload, "adamw", timeout=300)
    for result in results:
        assert all(result["offloaded"]) and result["host"]
        # Same fp32 masters and math (the CPU Adam's fused multiply-adds round an fp32 ulp
        # differently); a bf16 rounding of a weight may flip: one bf16 ulp.
        assert max(result["diffs"]) <= 2**-7, result["diffs"]
        plain_norm, offloaded_norm = result["norms"]
        assert offloaded_norm == pytest.approx(plain_norm, rel=1e-3)


def _stage2_engine(zero: dict, bf16: bool = False) -> object:
    """A ZeRO-2 engine over the tiny model (AdamW, clipping) with ``zero``'s extra keys."""
    import slipstream
    from slipstream.zero.testing import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": 2, **zero},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return slipstream.initialize(model=model, optimizer=optimizer, config=config)[0]


def _train(engine, steps: range) -> None:
    """One micro-batch per step, this rank's slice of the global batch."""
    from slipstream import comm
    from slipstream.zero.testing import batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    device = next(engine.module.parameters()).device
    for step in steps:
        ids, labels = (t.to(device) for t in batch_for(step, 0, MICRO * world))
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(ids[mine], labels[mine]))
        engine.step()


def _weights(engine) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in engine.module.parameters()]


def _nvme_checkpoint_and_disk_full(swap_dir: str, checkpoint_dir: str) -> dict:
    """NVMe offload: a checkpoint round trip, then a disk that fills mid-step."""
    import errno

    from slipstream.offload import DiskFullError

    def build() -> object:
        offload = {"device": "nvme", "nvme_path": swap_dir}
        return _stage2_engine({"sub_group_size": 700, "offload_optimizer": offload})

    train, weights = _train, _weights

    first = build()
    train(first, range(2))
    first.save_checkpoint(checkpoint_dir, tag="two")
    train(first, range(2, 3))
    expected = weights(first)

    resumed = build()
    resumed.load_checkpoint(checkpoint_dir, tag="two")
    train(resumed, range(2, 3))
    resumed_equal = all(torch.equal(a, b) for a, b in zip(weights(resumed), expected))

    # The drive fills while the step writes the states back: a clear error, no silent loss.
    space = resumed.zero.optimizer.offload.space
    space.engine._inject_error(errno.ENOSPC, op="write")
    message = ""
    try:
        train(resumed, range(3, 4))
    except DiskFullError as exc:
        message = str(exc)
    # The engine refuses to go on (or to save) from a half-applied step, naming the cause.
    refusals = []
    for attempt in (
        lambda: train(resumed, range(4, 5)),
        lambda: resumed.save_checkpoint(checkpoint_dir, tag="after-failure"),
    ):
        try:
            attempt()
        except RuntimeError as exc:
            refusals.append(str(exc))
    # The last checkpoint is untouched and still loads.
    again = build()
    again.load_checkpoint(checkpoint_dir, tag="two")
    train(again, range(2, 3))
    checkpoint_intact = all(torch.equal(a, b) for a, b in zip(weights(again), expected))
    return {
        "resumed_equal": resumed_equal,
        "message": message,
        "checkpoint_intact": checkpoint_intact,
        "refusals": refusals,
    }


def test_nvme_offload_checkpoints_and_a_full_disk(tmp_path) -> None:
    swap, checkpoints = tmp_path / "nvme", tmp_path / "ckpt"
    swap.mkdir()
    (result,) = run_distributed(
        _nvme_checkpoint_and_disk_full, 1, str(swap), str(checkpoints), timeout=300
    )
    assert result["resumed_equal"]
    assert "no space left on device" in result["message"]
    assert str(swap) in result["message"]
    assert result["checkpoint_intact"]
    assert len(result["refusals"]) == 2, result["refusals"]
    for refusal in result["refusals"]:
        assert "DiskFullError" in refusal and "load the last checkpoint" in refusal
    assert not (checkpoints / "after-failure").exists()
    assert not any(swap.iterdir()), "swap folders must be removed when the process ends"


def _nvme_params_checkpoint(swap_dir: str, checkpoint_dir: str, optimizer_device: str) -> dict:
    """Parameter shards on NVMe: train, save, train on; a fresh engine loads and matches."""
    import slipstream
    from slipstream.zero import GatheredParameters
    from slipstream.zero.testing import TinyTransformer, batch_for

    def build() -> object:
        torch.manual_seed(0)
        model = TinyTransformer()
        zero: dict = {
            "stage": 3,
            "sub_group_size": 700,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "max_in_cpu": 0},
        }
        if optimizer_device != "none":  # "none": the optimizer steps on the compute device
            zero["offload_optimizer"] = {"device": optimizer_device, "nvme_path": swap_dir}
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": CLIP,
            "steps_per_print": 1000,
            "zero_optimization": zero,
            "aio": {"block_size": 4096, "queue_depth": 4},
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        return slipstream.initialize(model=model, optimizer=optimizer, config=config)[0]

    def train(engine, steps: range) -> None:
        for step in steps:
            ids, labels = batch_for(step, 0, MICRO)
            engine.backward(engine(ids, labels))
            engine.step()

    def weights(engine) -> list[torch.Tensor]:
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            return [p.detach().clone() for p in params]

    first = build()
    train(first, range(2))
    first.save_checkpoint(checkpoint_dir, tag="two")
    train(first, range(2, 4))
    expected = weights(first)
    store = first._stage3.store
    swapped = sum(store.is_swapped(t) for t in store.tensors())

    resumed = build()
    resumed.load_checkpoint(checkpoint_dir, tag="two")
    train(resumed, range(2, 4))
    equal = all(torch.equal(a, b) for a, b in zip(weights(resumed), expected))
    return {"equal": equal, "swapped": swapped, "total": len(store.tensors())}


@pytest.mark.parametrize("optimizer_device", ["cpu", "nvme", "none"])
def test_nvme_param_offload_checkpoint_round_trip(tmp_path, optimizer_device) -> None:
    swap, checkpoints = tmp_path / "nvme", tmp_path / "ckpt"
    swap.mkdir()
    (result,) = run_distributed(
        _nvme_params_checkpoint, 1, str(swap), str(checkpoints), optimizer_device, timeout=300
    )
    assert result["equal"]
    assert result["swapped"] == result["total"] > 0  # max_in_cpu=0: every shard on disk
    assert not any(swap.iterdir()), "swap folders must be removed when the process ends"


def _nvme_vs_cpu_params_on_device(swap_dir: str) -> dict:
    """Parameter shards on NVMe against the same shards in host memory, on the GPU, in bf16:
    the two runs must be the same bit for bit (only where the shards wait differs)."""
    import slipstream
    from slipstream.zero import GatheredParameters
    from slipstream.zero.testing import TinyTransformer, batch_for

    device = torch.device("cuda", torch.cuda.current_device())
    engines = []
    for offload_param in (
        {"device": "cpu", "pin_memory": True},
        {"device": "nvme", "nvme_path": swap_dir, "max_in_cpu": 0, "pin_memory": True},
    ):
        torch.manual_seed(0)
        model = TinyTransformer()
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": CLIP,
            "steps_per_print": 1000,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": 600,
                "stage3_param_persistence_threshold": 0,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": offload_param,
            },
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        engines.append(slipstream.initialize(model=model, optimizer=optimizer, config=config)[0])
    losses: list[list[float]] = []
    for step in range(4):
        ids, labels = (t.to(device) for t in batch_for(step, 0, MICRO))
        pair = []
        for engine in engines:
            loss = engine(ids, labels)
            engine.backward(loss)
            engine.step()
            pair.append(float(loss.detach()))
        losses.append(pair)
    params = [p for e in engines for p in e.module.parameters()]
    with GatheredParameters(params):
        equal = all(
            torch.equal(p, q)
            for p, q in zip(engines[0].module.parameters(), engines[1].module.parameters())
        )
    store = engines[1]._stage3.store
    return {"losses": losses, "equal": equal, "swapped": store.is_swapped(store.tensors()[0])}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_nvme_params_match_host_params_on_a_gpu(tmp_path) -> None:
    (result,) = run_distributed(
        _nvme_vs_cpu_params_on_device, 1, str(tmp_path), backend="nccl", timeout=300
    )
    assert all(a == b for a, b in result["losses"]), result["losses"]
    assert result["equal"]
    assert result["swapped"]


def _destroy_removes_swap_files(swap_dir: str) -> dict:
    import os

    import slipstream
    from slipstream.zero.testing import TinyTransformer, batch_for

    torch.manual_seed(0)
    model = TinyTransformer()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap_dir},
            "offload_param": {"device": "nvme", "nvme_path": swap_dir, "max_in_cpu": 0},
        },
        "aio": {"block_size": 4096, "queue_depth": 4},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine = slipstream.initialize(model=model, optimizer=optimizer, config=config)[0]
    ids, labels = batch_for(0, 0, MICRO)
    engine.backward(engine(ids, labels))
    engine.step()
    before = sorted(os.listdir(swap_dir))
    engine.destroy()
    after = sorted(os.listdir(swap_dir))
    engine.destroy()  # idempotent
    errors = []
    for call in (lambda: engine(ids, labels), engine.step, lambda: engine.save_checkpoint("x")):
        try:
            call()
        except RuntimeError as exc:
            errors.append(str(exc))
    return {"before": before, "after": after, "errors": errors}


def test_destroy_removes_the_swap_files_and_refuses_further_use(tmp_path) -> None:
    (result,) = run_distributed(_destroy_removes_swap_files, 1, str(tmp_path), timeout=300)
    assert any(n.startswith("slipstream-param-") for n in result["before"])
    assert any(n.startswith("slipstream-optimizer") for n in result["before"]), result["before"]
    assert result["after"] == []
    assert len(result["errors"]) == 3
    assert all("engine.destroy()" in e for e in result["errors"])


def _partial_offload_checkpoint(checkpoint_dir: str) -> dict:
    """Partial offload: a checkpoint round trip, and the same checkpoint under another ratio."""

    def build(ratio: float) -> object:
        offload = {"device": "cpu", "ratio": ratio}
        zero = {"reduce_bucket_size": 600, "offload_optimizer": offload}
        return _stage2_engine(zero, bf16=torch.cuda.is_available())

    train, weights = _train, _weights

    first = build(0.5)
    train(first, range(2))
    first.save_checkpoint(checkpoint_dir, tag="two")
    train(first, range(2, 4))
    expected = weights(first)
    devices = sorted({str(m.device) for m in first.zero.masters.masters})

    resumed = build(0.5)
    resumed.load_checkpoint(checkpoint_dir, tag="two")
    train(resumed, range(2, 4))
    same_ratio_equal = all(torch.equal(a, b) for a, b in zip(weights(resumed), expected))

    # Every state moves to where the other ratio keeps its master (host or device).
    whole = build(1.0)
    whole.load_checkpoint(checkpoint_dir, tag="two")
    moved = all(
        v.device == m.device
        for m in whole.zero.masters.masters
        for v in whole.optimizer.state[m].values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    train(whole, range(2, 4))
    worst = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        for a, b in zip(weights(whole), expected)
    )
    return {"same": same_ratio_equal, "moved": moved, "worst": worst, "devices": devices}


def test_partial_offload_checkpoint_round_trip(tmp_path) -> None:
    for result in run_distributed(_partial_offload_checkpoint, 2, str(tmp_path), timeout=300):
        assert result["same"]  # same ratio: bit for bit
        assert result["moved"]
        # Full offload steps the formerly kept masters with the C++ Adam instead of torch's.
        assert result["worst"] <= TOLERANCE["adamw"][0], result["worst"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_partial_offload_checkpoint_round_trip_on_gpus(tmp_path) -> None:
    world = min(2, torch.cuda.device_count())
    results = run_distributed(
        _partial_offload_checkpoint, world, str(tmp_path), backend="nccl", timeout=300
    )
    for result in results:
        assert len(result["devices"]) == 2 and result["devices"][0] == "cpu"  # host and GPU
        assert result["same"] and result["moved"]
        assert result["worst"] <= 2**-7, result["worst"]  # bf16 weights: one ulp may flip


def test_gpu_share_config_needs_stage_1_or_2_on_the_cpu() -> None:
    from slipstream.config import ConfigError, SlipstreamConfig

    for stage, device, extra in ((3, "cpu", {}), (2, "nvme", {"nvme_path": "/tmp/x"})):
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {
                "stage": stage,
                "offload_optimizer": {"device": device, "gpu_share": 0.5, **extra},
            },
        }
        with pytest.raises(ConfigError, match=r"gpu_share=0\.5 needs ZeRO stage 1 or 2"):
            SlipstreamConfig.from_dict(config)
    bad = {"zero_optimization": {"stage": 2, "offload_optimizer": {"gpu_share": 1.5}}}
    with pytest.raises(ConfigError, match="gpu_share"):
        SlipstreamConfig.from_dict({"train_micro_batch_size_per_gpu": 1, **bad})
