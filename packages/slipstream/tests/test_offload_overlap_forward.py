"""CPU offload with ``overlap_forward``: the optimizer step ends during the next forward.

``engine.step()`` returns while the CPU still steps the last gradient buckets; the next
forward publishes each bucket as it reaches the bucket's parameters, and the step is committed
once the last one is done. The run must be the run without it, bit for bit: the same losses
(so every forward saw every parameter it used up to date), and the same weights, masters,
Adam states and step counts wherever they are read through the engine. A scheduler moves the
learning rate every step, so a bucket stepped after ``step()`` returned with the next step's
rate would show.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("slipstream.offload")

MICRO = 2
KEEP, CLIP = 1e3, 1e-3  # a clip the norm never reaches, and one it always exceeds
CLIPS = [KEEP, KEEP, CLIP, CLIP, KEEP, KEEP, KEEP]  # kept, discarded (paused once), kept


def _config(
    stage: int,
    precision: str,
    gas: int,
    clip: float,
    ratio: float,
    overlap: bool,
    speculate: bool = True,
    merge: int = 0,
    upload: bool = False,
):
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 20},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 600,  # several buckets, each stepped as it lands
            "allgather_bucket_size": 500,
            "offload_optimizer": {
                "device": "cpu",
                "pin_memory": torch.cuda.is_available(),
                "ratio": ratio,
                "overlap_forward": overlap,
                "speculative_step": speculate,
                "merge_bucket_size": merge,
                "upload_model_dtype": upload,
            },
        },
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":  # a loss scale this model never overflows: every step speculates
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _engine(stage, precision, gas, clip, ratio, overlap, speculate=True, merge=0, upload=False):
    import slipstream
    from slipstream.zero.testing import TinyTransformer, two_group_params

    torch.manual_seed(0)
    model = TinyTransformer(unused=True)  # a parameter no forward reaches, too
    optimizer = torch.optim.AdamW(two_group_params(model), lr=0.01)
    config = _config(stage, precision, gas, clip, ratio, overlap, speculate, merge, upload)
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _everything(engine) -> list[torch.Tensor]:
    state = engine.optimizer.state
    masters = engine.zero.masters.masters
    return (
        [p.detach().clone() for p in engine.module.parameters()]
        + [m.detach().clone() for m in masters]
        + [state[m][k].clone() for m in masters if state[m] for k in ("exp_avg", "exp_avg_sq")]
        + [torch.tensor([float(state[m]["step"]) for m in masters if state[m]])]
    )


def _run(
    stage, precision, gas, clipping, ratio, overlap, early=False, merge=0, upload=False
) -> dict:
    """Train through CLIPS (or without clipping); losses, snapshots, what was deferred, how
    many deferred buckets were published from an upload staged as their CPU step ended (on a
    GPU always; on the CPU only with ``early``), and the worker's jobs and calls (``merge``:
    merge_bucket_size)."""
    from slipstream import comm
    from slipstream.zero.testing import batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    clips = CLIPS if clipping else [0.0] * len(CLIPS)
    engine = _engine(stage, precision, gas, clips[0], ratio, overlap, merge=merge, upload=upload)
    device = next(engine.module.parameters()).device
    offload = engine.zero.optimizer.offload
    jobs = []
    reducer = engine.zero.reducer
    submit = reducer.on_final_bucket  # the worker's submit, as the reducer holds it
    reducer.on_final_bucket = lambda *args: jobs.append(1) or submit(*args)
    if early:
        offload.stage_upload = engine.zero._stage_upload
    staged = []
    claim = offload._claim

    def counted(job):
        upload = claim(job)
        staged.append(upload is not None)
        return upload

    offload._claim = counted
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    losses, snapshots, deferred = [], [], []
    for step, clip in enumerate(clips):
        engine.config.gradient_clipping = clip
        for micro in range(gas):
            ids, labels = (t.to(device) for t in batch_for(step, micro, MICRO * world))
            loss = engine(ids[mine], labels[mine])
            losses.append(loss.detach().float().cpu())
            if micro == 0 and step % 2 == 1:
                # Odd steps: read everything between the forward and the backward, which
                # must show the last step whole (the even steps leave it to the backward).
                engine.wait_for_step()
                snapshots.append(_everything(engine))
            engine.backward(loss)
            engine.step()
        deferred.append(len(offload.tail))
    engine.wait_for_step()
    snapshots.append(_everything(engine))
    stats = offload.speculation
    return {
        "losses": torch.stack(losses),
        "snapshots": snapshots,
        "deferred": deferred,
        "overlap": offload.overlap_forward,
        "stats": (stats.kept, stats.discarded, stats.paused),
        "staged": sum(staged),
        "jobs": len(jobs),
        "calls": offload.worker_calls,
        "staging": engine.zero._staging is not None,
    }


def _side_by_side(
    stage, precision, gas, clipping, ratio, early=False, merge=0, overlap_on=True, upload=False
) -> dict:
    """``overlap_on`` (with ``early``, ``merge`` and ``upload``) against the plain run."""
    on = _run(stage, precision, gas, clipping, ratio, overlap_on, early, merge, upload)
    off = _run(stage, precision, gas, clipping, ratio, False)
    first_difference = None
    for index, (a, b) in enumerate(zip(on["snapshots"], off["snapshots"])):
        if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
            first_difference = index
            break
    return {
        "same_losses": torch.equal(on["losses"], off["losses"]),
        "first_difference": first_difference,
        "snapshots": len(on["snapshots"]),
        "deferred": on["deferred"],
        "staged": on["staged"],
        "on": (on["overlap"], on["stats"]),
        "off": (off["overlap"], off["stats"]),
        "jobs": (on["jobs"], off["jobs"]),
        "calls": (on["calls"], off["calls"]),
        "staging": (on["staging"], off["staging"]),
    }


@pytest.mark.parametrize(
    ("stage", "world", "precision", "gas", "clipping", "ratio"),
    [
        (2, 1, "fp32", 1, True, 1.0),
        (2, 2, "fp32", 1, True, 1.0),
        (2, 2, "bf16", 2, True, 1.0),
        (1, 2, "bf16", 2, True, 1.0),
        (2, 4, "bf16", 1, True, 1.0),
        # No clipping: the exact step during backward (overlap_step).
        (2, 2, "bf16", 1, False, 1.0),
        (1, 2, "fp32", 2, False, 1.0),
        # Partial offload: the device's share steps and publishes in step().
        (2, 2, "fp32", 1, True, 0.5),
        (1, 2, "bf16", 1, False, 0.6),
        # fp16 loss scaling: the speculative step, with and without clipping.
        (2, 2, "fp16", 1, True, 1.0),
        (1, 1, "fp16", 2, False, 1.0),
    ],
)
def test_overlap_forward_is_the_same_run_bit_for_bit(
    stage, world, precision, gas, clipping, ratio
) -> None:
    results = run_distributed(
        _side_by_side, world, stage, precision, gas, clipping, ratio, timeout=300
    )
    for result in results:
        assert result["on"][0] and not result["off"][0]
        assert result["on"][1] == result["off"][1]  # the same speculation history
        assert result["same_losses"]
        assert result["snapshots"] == len(CLIPS) // 2 + 1
        assert result["first_difference"] is None, result["first_difference"]
        # The steps really were left running: buckets were still deferred after step() on
        # every step whose CPU step ran during backward (all but the discarded and paused
        # ones under clipping).
        expected = (
            [True, True, False, False, False, True, True] if clipping else [True] * len(CLIPS)
        )
        assert [d > 0 for d in result["deferred"]] == expected, result["deferred"]


@pytest.mark.parametrize(
    ("stage", "world", "precision", "clipping", "ratio"),
    [(2, 2, "bf16", True, 1.0), (1, 2, "fp32", False, 1.0), (2, 2, "fp32", True, 0.5)],
)
def test_uploads_staged_as_each_bucket_steps_are_the_same_run(
    stage, world, precision, clipping, ratio
) -> None:
    # On a GPU each deferred bucket's upload starts on a stream of its own as soon as its CPU
    # step ends, and the forward's all-gather takes it from there; the CPU runs the same
    # hand-over (a packed send buffer, made on the worker thread) when forced to.
    results = run_distributed(
        _side_by_side, world, stage, precision, 1, clipping, ratio, True, timeout=300
    )
    for result in results:
        assert result["same_losses"]
        assert result["first_difference"] is None, result["first_difference"]
        assert result["staged"] > 0


@pytest.mark.parametrize(
    ("stage", "world", "precision", "gas", "clipping", "overlap", "merge"),
    [
        # Every landed bucket in one call, under clipping (speculative, discarded, paused)
        # and without (the exact step during backward).
        (2, 2, "fp32", 1, False, False, 10**9),
        (1, 1, "bf16", 2, True, False, 10**9),
        # overlap_forward (newest first after backward), a cap of about two buckets' shards.
        (2, 2, "bf16", 1, True, True, 700),
    ],
)
def test_merged_bucket_steps_are_the_same_run(
    stage, world, precision, gas, clipping, overlap, merge
) -> None:
    # merge_bucket_size: the worker steps the landed buckets it would take next in one C++
    # call. The update is the same element by element, so the run is the same bit for bit.
    results = run_distributed(
        _side_by_side,
        world,
        stage,
        precision,
        gas,
        clipping,
        1.0,
        False,
        merge,
        overlap,
        timeout=300,
    )
    for result in results:
        assert result["on"][0] == overlap and result["on"][1] == result["off"][1]
        assert result["same_losses"]
        assert result["first_difference"] is None, result["first_difference"]
        (jobs_on, jobs_off), (calls_on, calls_off) = result["jobs"], result["calls"]
        assert jobs_on == jobs_off > 0 and calls_off == jobs_off  # the same buckets
        assert 0 < calls_on < jobs_on  # merged: fewer calls


def _checkpoint_and_state_dict(tmp: str) -> dict:
    """Read the model while a step is still running: state_dict(), a checkpoint and
    zero_grad()+step() without a forward between all see the finished step."""
    from slipstream import comm
    from slipstream.zero.testing import batch_for

    rank, world = comm.get_rank(), comm.get_world_size()
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    results = {}
    for overlap in (True, False):
        engine = _engine(2, "bf16", 1, KEEP, 1.0, overlap)
        for step in range(2):
            ids, labels = batch_for(step, 0, MICRO * world)
            engine.backward(engine(ids[mine], labels[mine]))
            engine.step()
        pending = len(engine.zero.optimizer.offload.tail)
        weights = {k: v.clone() for k, v in engine.module.state_dict().items()}
        path = engine.save_checkpoint(os.path.join(tmp, f"overlap{overlap}"), tag="t")
        # A zero_grad and a step with no forward between them: nothing is left to step.
        engine.zero_grad()
        engine.step()
        results[overlap] = {
            "pending": pending,
            "weights": weights,
            "files": sorted(os.listdir(path)),
            "after": _everything(engine),
        }
    on, off = results[True], results[False]
    loaded = {}
    for overlap in (True, False):
        engine = _engine(2, "bf16", 1, KEEP, 1.0, False)
        engine.load_checkpoint(os.path.join(tmp, f"overlap{overlap}"), tag="t")
        loaded[overlap] = _everything(engine)
    return {
        "pending": (on["pending"], off["pending"]),
        "same_state_dict": all(
            torch.equal(on["weights"][k], off["weights"][k]) for k in on["weights"]
        ),
        "same_files": on["files"] == off["files"],
        "same_after": all(torch.equal(a, b) for a, b in zip(on["after"], off["after"])),
        "same_loaded": all(torch.equal(a, b) for a, b in zip(loaded[True], loaded[False])),
    }


def test_state_dict_checkpoint_and_zero_grad_wait_for_the_step(tmp_path) -> None:
    for result in run_distributed(_checkpoint_and_state_dict, 2, str(tmp_path), timeout=300):
        assert result["pending"][0] > 0 and result["pending"][1] == 0
        assert result["same_state_dict"]
        assert result["same_files"]
        assert result["same_after"]
        assert result["same_loaded"]


def _slow_tail() -> dict:
    """With a slow CPU step, step() returns before it is done and the forward waits."""
    from slipstream import comm
    from slipstream.offload import HostOptimizer
    from slipstream.zero.testing import batch_for

    rank, world = comm.get_rank(), comm.get_world_size()
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    engine = _engine(2, "fp32", 1, KEEP, 1.0, True)
    ids, labels = batch_for(0, 0, MICRO * world)
    engine.backward(engine(ids[mine], labels[mine]))
    engine.step()
    engine.wait_for_step()  # nothing of step 0 may be queued when the step is held
    gate = threading.Event()
    original = HostOptimizer.speculate_params

    def held(self, params, grad_scale=1.0):
        gate.wait()
        original(self, params, grad_scale)

    HostOptimizer.speculate_params = held  # type: ignore[method-assign]
    try:
        ids, labels = batch_for(1, 0, MICRO * world)
        engine.backward(engine(ids[mine], labels[mine]))
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.step()  # returns with every bucket still held
        returned_early = not gate.is_set()
        unchanged = all(torch.equal(p, b) for p, b in zip(engine.module.parameters(), before))
        timer = threading.Timer(0.2, gate.set)
        timer.start()
        began = time.monotonic()
        ids, labels = batch_for(2, 0, MICRO * world)
        engine(ids[mine], labels[mine])  # the forward waits for the buckets it reaches
        waited = time.monotonic() - began
    finally:
        HostOptimizer.speculate_params = original  # type: ignore[method-assign]
        gate.set()
    moved = any(not torch.equal(p, b) for p, b in zip(engine.module.parameters(), before))
    return {
        "returned_early": returned_early,
        "unchanged": unchanged,
        "waited": waited,
        "moved": moved,
    }


def test_step_returns_before_the_cpu_step_and_the_forward_waits() -> None:
    for result in run_distributed(_slow_tail, 2, timeout=300):
        assert result["returned_early"]
        assert result["unchanged"]  # nothing published before the forward reached it
        assert result["waited"] >= 0.15
        assert result["moved"]


def test_overlap_forward_config_needs_stage_1_or_2_on_the_cpu() -> None:
    from slipstream.config import ConfigError, SlipstreamConfig

    for stage, device, extra in ((3, "cpu", {}), (2, "nvme", {"nvme_path": "/tmp/x"})):
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {
                "stage": stage,
                "offload_optimizer": {"device": device, "overlap_forward": True, **extra},
            },
        }
        with pytest.raises(ConfigError, match="overlap_forward needs ZeRO stage 1 or 2"):
            SlipstreamConfig.from_dict(config)


def _without_cpu_step_in_backward() -> dict:
    """Clipping without the speculative step steps after backward: overlap_forward says it
    has no effect."""
    import logging

    records: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Catch()
    logging.getLogger("slipstream").addHandler(handler)
    try:
        engine = _engine(2, "fp32", 1, 1.0, 1.0, True, speculate=False)
    finally:
        logging.getLogger("slipstream").removeHandler(handler)
    return {
        "on": engine.zero.optimizer.offload.overlap_forward,
        "warned": any("overlap_forward has no effect" in r for r in records),
    }


def test_overlap_forward_says_when_it_has_no_effect() -> None:
    (result,) = run_distributed(_without_cpu_step_in_backward, 1, timeout=300)
    assert not result["on"]
    assert result["warned"]


def _switch_interval_while_the_worker_runs() -> dict:
    """offload_optimizer.gil_switch_interval_us reaches the CPU step's worker: Python's switch
    interval is the key's while the worker runs and the previous one after destroy()."""
    import sys

    import slipstream
    from slipstream.zero.testing import TinyTransformer, batch_for

    before = sys.getswitchinterval()
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = _config(2, "fp32", 1, 1.0, 1.0, True)
    config["zero_optimization"]["offload_optimizer"]["gil_switch_interval_us"] = 250
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    ids, labels = batch_for(0, 0, MICRO)
    engine.backward(engine(ids, labels))
    engine.step()
    during = sys.getswitchinterval()
    engine.destroy()
    return {"before": before, "during": during, "after": sys.getswitchinterval()}


def test_the_worker_runs_with_the_configured_switch_interval() -> None:
    (result,) = run_distributed(_switch_interval_while_the_worker_runs, 1, timeout=300)
    assert result["during"] == pytest.approx(250e-6)
    assert result["after"] == pytest.approx(result["before"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize(
    ("stage", "clipping", "ratio"), [(2, True, 1.0), (1, False, 1.0), (2, True, 0.5)]
)
def test_overlap_forward_is_the_same_run_bit_for_bit_on_gpus(stage, clipping, ratio) -> None:
    # The buckets land through pinned memory on a side stream and step on the CPU worker,
    # newest first; the next forward uploads and all-gathers each as it reaches it.
    world = min(2, torch.cuda.device_count())
    results = run_distributed(
        _side_by_side, world, stage, "bf16", 1, clipping, ratio, backend="nccl", timeout=300
    )
    for result in results:
        assert result["on"][0] and result["on"][1] == result["off"][1]
        assert result["same_losses"]
        assert result["first_difference"] is None, result["first_difference"]
        assert any(d > 0 for d in result["deferred"])
        assert result["staged"] > 0  # uploads started as the buckets' CPU steps ended


@pytest.mark.parametrize(
    ("stage", "world", "precision", "gas", "clipping", "overlap"),
    [
        (2, 2, "bf16", 1, True, True),  # speculative (kept, discarded, paused), overlap_forward
        (1, 2, "bf16", 2, False, False),  # the exact step during backward, accumulation
        (2, 1, "fp16", 1, True, True),  # fp16: an overflow-free run with loss scaling
    ],
)
def test_model_dtype_uploads_are_the_same_run(stage, world, precision, gas, clipping, overlap):
    # upload_model_dtype: the CPU step writes each updated master rounded to the model's dtype
    # into a staging buffer (as the device's cast would round it), and that is published.
    results = run_distributed(
        _side_by_side,
        world,
        stage,
        precision,
        gas,
        clipping,
        1.0,
        True,  # early uploads (packed on the worker) on the CPU too
        0,
        overlap,
        True,
        timeout=300,
    )
    for result in results:
        assert result["staging"] == (True, False)
        assert result["on"][1] == result["off"][1]
        assert result["same_losses"]
        assert result["first_difference"] is None, result["first_difference"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize("case", ["merged", "model_dtype"])
@pytest.mark.parametrize(("overlap", "clipping"), [(True, True), (False, False)])
def test_merged_steps_and_model_dtype_uploads_are_the_same_run_on_gpus(
    case, overlap, clipping
) -> None:
    # Buckets land through pinned memory on a side stream. "merged": the worker merges those
    # that have landed (each one's wait for its copy and hand-over, then one C++ call).
    # "model_dtype": the bf16 copies the C++ step writes are uploaded (pinned, early on a side
    # stream with overlap_forward) instead of the fp32 masters the GPU would cast.
    merged = case == "merged"
    world = min(2, torch.cuda.device_count())
    results = run_distributed(
        _side_by_side,
        world,
        2,
        "bf16",
        1,
        clipping,
        1.0,
        False,
        10**9 if merged else 0,
        overlap,
        not merged,
        backend="nccl",
        timeout=300,
    )
    for result in results:
        assert result["same_losses"]
        assert result["first_difference"] is None, result["first_difference"]
        if merged:
            assert result["on"][0] == overlap and result["on"][1] == result["off"][1]
            assert result["jobs"][0] == result["jobs"][1] > 0
        else:
            assert result["staging"] == (True, False)
