"""CPU/NVMe offload with a bf16 gradient reduction: the gradients reach the CPU step in bf16.

With ``communication_data_type: bf16`` a step's gradients are reduced in bf16. When that
reduction is the only one of the step (no accumulation on the host), it lands on the host in
bf16 and the C++ CPU step reads it there, widening each value exactly; before, it was widened
to fp32 on the way (twice the bytes over PCIe and through host memory). The run must be the
run with fp32 landing bit for bit: same model weights, masters, Adam states and norms after
every step, with and without the speculative step under clipping, with gradient accumulation
(summed in fp32 as before), and with the states on NVMe.
"""

from __future__ import annotations

import os

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("slipstream.offload")

MICRO = 2
KEEP, CLIP = 1e3, 1e-3  # a clip the norm never reaches, and one it always exceeds
CLIPS = [KEEP, KEEP, CLIP, KEEP, KEEP]


def _run(stage: int, gas: int, land_low: bool, speculate: bool, device: str, tmp: str) -> dict:
    import slipstream
    from slipstream import comm
    from slipstream.zero.offload import OffloadedStep
    from slipstream.zero.testing import TinyTransformer, batch_for, two_group_params

    # The switch under test: whether the stage may let bf16 reductions land in bf16.
    OffloadedStep.reads_low_precision_grads = property(  # type: ignore[method-assign]
        lambda self: land_low and self.host.kernel is not None
    )
    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer(unused=True)
    optimizer = torch.optim.AdamW(two_group_params(model), lr=0.01)
    offload: dict = {
        "device": device,
        "pin_memory": torch.cuda.is_available(),
        "speculative_step": speculate,
    }
    if device == "cpu-partial":  # the first parameters' masters stay with the model
        offload.update(device="cpu", ratio=0.5)
    params = {"offload_param": {"device": "cpu"}} if device == "cpu+param" else {}
    if device == "cpu+param":  # stage 3: the parameter shards live on the host too
        offload["device"] = "cpu"
    if device == "nvme":
        offload["nvme_path"] = os.path.join(tmp, f"land-{int(land_low)}")
        os.makedirs(offload["nvme_path"], exist_ok=True)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIPS[0],
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
        "communication_data_type": "bf16",
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 600,
            "allgather_bucket_size": 500,
            "offload_optimizer": offload,
            **params,
        },
    }
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    dev = next(engine.module.parameters()).device
    masters = engine.zero.masters
    snapshots, landed, norms = [], [], []
    for step, clip in enumerate(CLIPS):
        engine.config.gradient_clipping = clip
        for micro in range(gas):
            ids, labels = (t.to(dev) for t in batch_for(step, micro, MICRO * world))
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            engine.backward(engine(ids[mine], labels[mine]))
            if micro == gas - 1:  # what the step is about to read
                landed.append(sorted({str(g.dtype) for g in masters.landed.values()}))
                # Only offloaded masters' gradients land on the host.
                assert all(masters.offloaded[i] for i in masters.landed)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
        state = engine.optimizer.state
        stepped = [m for m in masters.masters if state[m]]  # not the unused parameter
        with engine.zero.optimizer.resident():
            if stage < 3:
                _check_published(engine, rank, device)
            # Stage 3's module parameters hold no storage outside forward: its shards.
            weights = (
                [s.shard.detach().clone() for s in engine.zero.sharded]
                if stage == 3
                else [p.detach().clone() for p in engine.module.parameters()]
            )
            snapshots.append(
                weights
                + [m.detach().clone() for m in masters.masters]
                + [state[m][k].clone() for m in stepped for k in ("exp_avg", "exp_avg_sq")]
            )
    speculation = engine.zero.optimizer.offload.speculation
    return {
        "snapshots": snapshots,
        "landed": landed,
        "norms": norms,
        "kept": speculation.kept,
        "discarded": speculation.discarded,
    }


def _check_published(engine, rank: int, device: str) -> None:
    # Stages 1-2 with CPU offload publish the fp32 masters and round them to bf16 on the way
    # (the CPU step writes no model-dtype copy); NVMe swaps the masters out after the step,
    # so it stages copies. Either way each parameter holds its master rounded to bf16.
    zero = engine.zero
    assert bool(zero.optimizer.offload.host.copies) == (device == "nvme")
    for param, master, spec in zip(zero.params, zero.masters.masters, zero.specs):
        lo, hi = spec.valid_range(rank)
        mine = param.detach().reshape(-1)[lo:hi]
        assert torch.equal(mine, master.detach().reshape(-1)[: hi - lo].to(mine.device, mine.dtype))


def _side_by_side(stage: int, gas: int, speculate: bool, device: str, tmp: str) -> dict:
    low = _run(stage, gas, True, speculate, device, tmp)
    wide = _run(stage, gas, False, speculate, device, tmp)
    first_difference = None
    for step, (a, b) in enumerate(zip(low["snapshots"], wide["snapshots"])):
        if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
            first_difference = step
            break
    drop = ("snapshots",)
    return {
        "low": {k: v for k, v in low.items() if k not in drop},
        "wide": {k: v for k, v in wide.items() if k not in drop},
        "first_difference": first_difference,
    }


@pytest.mark.parametrize(
    ("stage", "world", "gas", "speculate", "device"),
    [
        (2, 2, 1, True, "cpu"),
        (2, 4, 1, False, "cpu"),
        (1, 2, 2, True, "cpu"),
        (2, 1, 2, False, "cpu"),
        (2, 2, 1, False, "nvme"),
        (2, 2, 1, True, "cpu-partial"),
        (3, 2, 1, False, "cpu"),
        (3, 1, 2, False, "cpu"),
        (3, 2, 1, False, "nvme"),
        (3, 2, 1, False, "cpu+param"),
        (3, 4, 1, False, "cpu-partial"),
    ],
)
def test_bf16_reduction_lands_in_bf16_and_steps_bit_for_bit(
    stage, world, gas, speculate, device, tmp_path
) -> None:
    results = run_distributed(
        _side_by_side, world, stage, gas, speculate, device, str(tmp_path), timeout=300
    )
    # Stages 2 and 3 with accumulation reduce on every micro-step: the step's gradient is a
    # sum taken on the host in fp32, so nothing lands in bf16 there.
    lands = not (stage >= 2 and gas > 1)
    for result in results:
        low, wide = result["low"], result["wide"]
        assert low["landed"] == [["torch.bfloat16"] if lands else []] * len(CLIPS)
        assert wide["landed"] == [[]] * len(CLIPS)
        assert low["norms"] == wide["norms"]
        assert 0 < low["norms"][0] < KEEP
        if speculate:  # kept and discarded speculative steps both read the bf16 gradients
            assert low["kept"] > 0 and low["discarded"] > 0
            assert (low["kept"], low["discarded"]) == (wide["kept"], wide["discarded"])
        assert result["first_difference"] is None, result["first_difference"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize(("stage", "speculate"), [(2, True), (2, False), (3, False)])
def test_bf16_reduction_lands_in_bf16_on_gpus(stage, speculate, tmp_path) -> None:
    # The bf16 buckets are copied into pinned bf16 buffers on the side stream (no widening on
    # the device) and stepped from there.
    world = min(2, torch.cuda.device_count())
    results = run_distributed(
        _side_by_side, world, stage, 1, speculate, "cpu", str(tmp_path), backend="nccl", timeout=300
    )
    for result in results:
        assert result["low"]["landed"] == [["torch.bfloat16"]] * len(CLIPS)
        assert result["low"]["norms"] == result["wide"]["norms"]
        assert result["first_difference"] is None, result["first_difference"]


def _stage3_publishes(steps: int) -> dict:
    import slipstream
    from slipstream import comm
    from slipstream.zero.testing import TinyTransformer, batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 600,
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
        },
    }
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    dev = engine.device
    path = engine.zero
    mismatched, checked = [], 0
    for step in range(steps):
        ids, labels = (t.to(dev) for t in batch_for(step, 0, MICRO * world))
        mine = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(engine(ids[mine], labels[mine]))
        engine.step()
        # Each device shard holds its fp32 master rounded to bf16; no copy is staged.
        for i, (sharded, master) in enumerate(zip(path.sharded, path.masters.masters)):
            shard = sharded.shard
            expected = master.detach().to(shard.device, torch.bfloat16)
            checked += 1
            if shard.device.type != dev.type or not torch.equal(shard, expected):
                mismatched.append((step, i))
    return {
        "mismatched": mismatched,
        "checked": checked,
        "copies": len(path.optimizer.offload.host.copies),
        "loss": float(engine(ids[mine], labels[mine]).detach()),
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_stage3_cpu_offload_publishes_rounded_masters_on_gpus() -> None:
    # Stage 3 with CPU optimizer offload and the shards on the GPU: _publish uploads each fp32
    # master and casts it there (the CPU step writes no bf16 staging copy).
    world = min(2, torch.cuda.device_count())
    for result in run_distributed(_stage3_publishes, world, 3, backend="nccl", timeout=300):
        assert result["checked"] > 0 and result["mismatched"] == [], result["mismatched"]
        assert result["copies"] == 0
        assert result["loss"] == result["loss"]  # finite training, not NaN
