"""CPU offload under gradient clipping: the speculative step during backward.

With clipping, each bucket steps on the CPU during backward as if nothing were clipped, out of
place; the step keeps that update when the global norm agrees and otherwise steps again after
backward. Either way the run must be the run without speculation, bit for bit: same masters,
same Adam states, same model weights after every step. The clip threshold is switched between
steps so that speculation is kept, discarded, and paused by the back-off.
"""

from __future__ import annotations

import copy

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("slipstream.offload")

MICRO = 2
KEEP, CLIP = 1e3, 1e-3  # a clip the norm never reaches, and one it always exceeds
# Kept twice, discarded twice (which pauses speculation for one step), then kept again.
CLIPS = [KEEP, KEEP, CLIP, CLIP, KEEP, KEEP, KEEP]
# The second discard is called off at the end of backward already (the norm is checked against
# the previous step's threshold, which was the same), before the buckets after it stepped;
# not at stage 2 with gradient accumulation, where the boundary's gradients are summed on the
# host and there is no norm before the step.
EXPECTED = {"kept": 4, "discarded": 2, "cancelled": 1, "paused": 1}


def _run(
    stage: int,
    precision: str,
    gas: int,
    speculate: bool,
    ratio: float = 1.0,
    clips: tuple[float, ...] = tuple(CLIPS),
    overflow_at: int | None = None,
    gpu_share: float = 0.0,
) -> dict:
    """Train with the ``clips`` schedule; every step's weights, masters and states. fp16:
    the loss of step ``overflow_at`` is made infinite (the step is skipped). ``gpu_share``:
    that share of each CPU step's elements steps on the device, streamed."""
    import slipstream
    from slipstream import comm
    from slipstream.zero.testing import TinyTransformer, batch_for, two_group_params

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer(unused=True)  # a parameter without a gradient, too
    optimizer = torch.optim.AdamW(two_group_params(model), lr=0.01)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clips[0],
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 600,  # several buckets, each stepped as it lands
            "allgather_bucket_size": 500,
            "offload_optimizer": {
                "device": "cpu",
                "pin_memory": torch.cuda.is_available(),
                "ratio": ratio,  # below 1: the first parameters step on the device
                "speculative_step": speculate,
                "gpu_share": gpu_share,
            },
        },
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":  # a dynamic loss scale of 2**8 that this model never overflows
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    device = next(engine.module.parameters()).device
    offload = engine.zero.optimizer.offload
    snapshots, scales = [], []
    for step, clip in enumerate(clips):
        engine.config.gradient_clipping = clip
        for micro in range(gas):
            ids, labels = (t.to(device) for t in batch_for(step, micro, MICRO * world))
            mine = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = engine(ids[mine], labels[mine])
            if step == overflow_at:
                loss = loss * float("inf")  # inf and nan gradients: an fp16 overflow
            engine.backward(loss)
            engine.step()
        if engine.loss_scaler is not None:
            scales.append(engine.loss_scaler.loss_scale)
        state = engine.optimizer.state
        masters = engine.zero.masters.masters
        snapshots.append(
            [p.detach().clone() for p in engine.module.parameters()]
            + [m.detach().clone() for m in masters]
            + [state[m][k].clone() for m in masters if state[m] for k in ("exp_avg", "exp_avg_sq")]
            + [torch.tensor([float(state[m]["step"]) for m in masters if state[m]])]
        )
    stats = offload.speculation
    norm = float(engine.get_global_grad_norm())
    return {
        "snapshots": snapshots,
        "speculative": offload.speculative,
        "eager": offload.eager,
        "stats": {
            "kept": stats.kept,
            "discarded": stats.discarded,
            "cancelled": stats.cancelled,
            "paused": stats.paused,
        },
        "norm": norm,
        "skipped": engine.skipped_steps,
        "scales": scales,
        "masters": len(engine.zero.masters.masters),
        "params": len(list(engine.module.parameters())),
        "streamed_on": (
            offload.host._streamed.device.type if offload.host._streamed is not None else None
        ),
        # The C++ step's clock: every call, and those made off the worker thread.
        "kernel_s": offload.kernel_s[0],
        "kernel_off_worker_s": offload.kernel_off_worker_s,
        "worker_busy_s": offload.worker_busy_s,
    }


def _side_by_side(
    stage: int,
    precision: str,
    gas: int,
    ratio: float = 1.0,
    clips: tuple[float, ...] = tuple(CLIPS),
    overflow_at: int | None = None,
) -> dict:
    on = _run(stage, precision, gas, True, ratio, clips, overflow_at)
    off = _run(stage, precision, gas, False, ratio, clips, overflow_at)
    first_difference = None
    for step, (a, b) in enumerate(zip(on["snapshots"], off["snapshots"])):
        if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
            first_difference = step
            break
    keys = (
        "speculative",
        "eager",
        "stats",
        "norm",
        "skipped",
        "scales",
        "kernel_s",
        "kernel_off_worker_s",
        "worker_busy_s",
    )
    return {
        "on": {k: on[k] for k in keys},
        "off": {k: off[k] for k in keys},
        "first_difference": first_difference,
    }


@pytest.mark.parametrize(
    ("stage", "world", "precision", "gas", "ratio"),
    [
        (2, 1, "fp32", 2, 1.0),
        (2, 2, "fp32", 1, 1.0),
        (1, 2, "bf16", 2, 1.0),
        (2, 4, "bf16", 1, 1.0),
        # Partial offload: the masters kept on the device step after backward whether the
        # speculative step is kept or not, and are published then.
        (2, 2, "fp32", 1, 0.5),
        (1, 2, "bf16", 2, 0.6),
    ],
)
def test_speculative_step_is_the_step_bit_for_bit(stage, world, precision, gas, ratio) -> None:
    results = run_distributed(_side_by_side, world, stage, precision, gas, ratio, timeout=300)
    expected = dict(EXPECTED, cancelled=0 if stage == 2 and gas > 1 else 1)
    for result in results:
        assert result["on"]["speculative"] and not result["on"]["eager"]
        assert not result["off"]["speculative"]
        assert result["on"]["stats"] == expected
        assert result["off"]["stats"] == {"kept": 0, "discarded": 0, "cancelled": 0, "paused": 0}
        assert 0 < result["on"]["norm"] < KEEP
        # The last step's norm came from the end-of-backward check's reduction: the same.
        assert result["on"]["norm"] == result["off"]["norm"]
        assert result["first_difference"] is None, result["first_difference"]
        # The clocks: without speculation every C++ step runs after backward, off the worker;
        # with it, the discarded and the paused steps do, the speculative ones on the worker.
        on, off = result["on"], result["off"]
        assert off["kernel_s"] > 0 and off["kernel_off_worker_s"] == off["kernel_s"]
        assert 0 < on["kernel_off_worker_s"] < on["kernel_s"] and on["worker_busy_s"] > 0


# fp16: kept twice, discarded twice under clipping (which pauses one step), an overflow at
# step 5 (discarded; called off at the end of backward, where the norm is already inf), kept.
FP16_CLIPS = (KEEP, KEEP, CLIP, CLIP, KEEP, KEEP, KEEP)
FP16_EXPECTED = {"kept": 3, "discarded": 3, "cancelled": 2, "paused": 1}


@pytest.mark.parametrize(
    ("stage", "world", "gas", "clipping", "ratio"),
    [
        (2, 2, 1, True, 1.0),
        (1, 2, 2, True, 1.0),
        # Stage 2 with accumulation has no norm before the step: the overflow's speculative
        # weights were published during backward and must be published again.
        (2, 2, 2, True, 1.0),
        (2, 1, 1, False, 1.0),  # no clipping: fp16 alone makes the step speculative
        (2, 2, 1, True, 0.5),
    ],
)
def test_fp16_speculative_step_is_the_step_bit_for_bit(stage, world, gas, clipping, ratio) -> None:
    # Under fp16 the speculative step assumes the factor 1/loss_scale (nothing clipped, no
    # overflow). An overflow skips the step: the speculation is discarded and the weights it
    # published during backward are published again from the unchanged masters.
    clips = FP16_CLIPS if clipping else (0.0,) * len(FP16_CLIPS)
    results = run_distributed(
        _side_by_side, world, stage, "fp16", gas, ratio, clips, 5, timeout=300
    )
    if clipping:
        expected = dict(FP16_EXPECTED, cancelled=0 if stage == 2 and gas > 1 else 2)
    else:  # only the overflow discards: once, no back-off
        expected = {"kept": 6, "discarded": 1, "cancelled": 1, "paused": 0}
    for result in results:
        on, off = result["on"], result["off"]
        assert on["speculative"] and not on["eager"] and not off["speculative"]
        assert not off["eager"]  # fp16 never steps exactly during backward
        assert on["stats"] == expected
        assert on["skipped"] == off["skipped"] == 1
        assert on["scales"] == off["scales"] and len(set(on["scales"])) > 1  # it moved
        assert on["norm"] == off["norm"]
        assert result["first_difference"] is None, result["first_difference"]


# A DeepSpeed config users bring (the corpus's Megatron GPT-2 ZeRO-2 CPU-offload test config,
# ds_tests_model_Megatron_GPT2_ds_config_func_bs4_zero2_offload.json): fp16 with a dynamic
# loss scale from 2**16, which overflows on the first steps, and clipping at 1.0.
MEGATRON_OFFLOAD = {
    "train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1,
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 7000000,
        "allgather_bucket_size": 7000000,
        "reduce_scatter": True,
        "cpu_offload": True,
    },
    "gradient_clipping": 1.0,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
}


def _corpus_fp16_run(speculate: bool) -> dict:
    import slipstream
    from slipstream import comm
    from slipstream.zero.testing import TinyTransformer, batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = copy.deepcopy(MEGATRON_OFFLOAD)
    if not speculate:  # the same offload, spelled out, with the speculative step off
        del config["zero_optimization"]["cpu_offload"]
        config["zero_optimization"]["offload_optimizer"] = {
            "device": "cpu",
            "speculative_step": False,
        }
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    micro = engine.train_micro_batch_size_per_gpu()
    mine = slice(rank * micro, (rank + 1) * micro)
    losses, scales = [], []
    for step in range(10):
        ids, labels = batch_for(step, 0, micro * world)
        loss = engine(ids[mine], labels[mine])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        scales.append(engine.loss_scaler.loss_scale)
    stats = engine.zero.optimizer.offload.speculation
    return {
        "losses": losses,
        "scales": scales,
        "skipped": engine.skipped_steps,
        "masters": [m.detach().clone() for m in engine.zero.masters.masters],
        "weights": [p.detach().clone() for p in engine.module.parameters()],
        "kept": stats.kept,
        "discarded": stats.discarded,
    }


def _corpus_fp16_side_by_side() -> dict:
    on, off = _corpus_fp16_run(True), _corpus_fp16_run(False)
    same = all(
        torch.equal(a, b)
        for key in ("masters", "weights")
        for a, b in zip(on[key], off[key], strict=True)
    )
    drop = ("masters", "weights")
    return {
        "on": {k: v for k, v in on.items() if k not in drop},
        "off": {k: v for k, v in off.items() if k not in drop},
        "same": same,
    }


def test_fp16_corpus_config_trains_the_same_with_speculation() -> None:
    # The loss scale starts at 2**16 and overflows until it has come down: those steps are
    # skipped, their speculation discarded. (This model's norm stays above the config's clip
    # of 1.0 in these steps, so the rest are discarded or paused too; the kept case is
    # test_fp16_speculative_step_is_the_step_bit_for_bit's.)
    for result in run_distributed(_corpus_fp16_side_by_side, 2, timeout=300):
        on, off = result["on"], result["off"]
        assert on["skipped"] == off["skipped"] > 0
        assert on["scales"] == off["scales"] and on["scales"][-1] < 2.0**16
        assert on["losses"] == off["losses"]
        assert on["discarded"] > 0 and off["discarded"] == 0, on
        assert result["same"]


def _abandoned(precision: str) -> dict:
    """A boundary backward that no step follows: zero_grad gives the model its weights back."""
    import slipstream
    from slipstream import comm
    from slipstream.zero.testing import TinyTransformer, batch_for

    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": KEEP,
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 600,
            "offload_optimizer": {"device": "cpu"},
        },
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    ids, labels = batch_for(0, 0, MICRO * world)
    engine.backward(engine(ids[mine], labels[mine]))
    engine.step()  # states exist from here on
    weights = [p.detach().clone() for p in engine.module.parameters()]
    masters = [m.detach().clone() for m in engine.zero.masters.masters]
    ids, labels = batch_for(1, 0, MICRO * world)
    engine.backward(engine(ids[mine], labels[mine]))
    moved = any(not torch.equal(p, w) for p, w in zip(engine.module.parameters(), weights))
    engine.zero_grad()  # e.g. a loop that skips this batch
    return {
        "moved_during_backward": moved,
        "weights_back": all(torch.equal(p, w) for p, w in zip(engine.module.parameters(), weights)),
        "masters_kept": all(
            torch.equal(m, k) for m, k in zip(engine.zero.masters.masters, masters)
        ),
        "stats": engine.zero.optimizer.offload.speculation.kept,
    }


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_grad_after_a_speculative_backward_restores_the_weights(precision) -> None:
    for result in run_distributed(_abandoned, 2, precision, timeout=300):
        assert result["moved_during_backward"]  # the speculative step was published...
        assert result["weights_back"]  # ...and withdrawn
        assert result["masters_kept"]
        assert result["stats"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize(("stage", "ratio"), [(1, 1.0), (2, 1.0), (2, 0.5)])
def test_speculative_step_is_the_step_bit_for_bit_on_gpus(stage, ratio) -> None:
    # The buckets land through pinned memory on a side stream and step on the CPU worker
    # while backward goes on; each published bucket is uploaded during backward. With
    # ratio 0.5 the first half of the parameters steps on the GPU after backward.
    world = min(2, torch.cuda.device_count())
    results = run_distributed(
        _side_by_side, world, stage, "bf16", 1, ratio, backend="nccl", timeout=300
    )
    for result in results:
        assert result["on"]["speculative"]
        assert result["on"]["stats"] == EXPECTED
        assert result["first_difference"] is None, result["first_difference"]


def _gpu_share_check() -> dict:
    """gpu_share 0.5 on GPUs: the speculative step is the step bit for bit (kept, discarded,
    paused), and the first step's masters agree with the CPU-only step to fp32 rounding."""
    on = _run(2, "bf16", 1, True, gpu_share=0.5)
    off = _run(2, "bf16", 1, False, gpu_share=0.5)
    cpu = _run(2, "bf16", 1, True, gpu_share=0.0)
    first_difference = None
    for step, (a, b) in enumerate(zip(on["snapshots"], off["snapshots"])):
        if len(a) != len(b) or not all(torch.equal(x, y) for x, y in zip(a, b)):
            first_difference = step
            break
    first = slice(on["params"], on["params"] + on["masters"])  # step 0's masters
    worst = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        for a, b in zip(on["snapshots"][0][first], cpu["snapshots"][0][first])
    )
    return {
        "first_difference": first_difference,
        "stats": on["stats"],
        "streamed_on": on["streamed_on"],
        "worst_vs_cpu": worst,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_gpu_share_speculative_step_on_gpus() -> None:
    # Half of each bucket's elements step on the GPU (master and states streamed from pinned
    # host memory and back) while the CPU steps the rest, during backward.
    world = min(2, torch.cuda.device_count())
    for result in run_distributed(_gpu_share_check, world, backend="nccl", timeout=300):
        assert result["streamed_on"] == "cuda"
        assert result["stats"] == EXPECTED
        assert result["first_difference"] is None, result["first_difference"]
        assert result["worst_vs_cpu"] <= 5e-6, result["worst_vs_cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
@pytest.mark.parametrize(("stage", "gas"), [(2, 1), (2, 2), (1, 1)])
def test_fp16_speculative_step_is_the_step_bit_for_bit_on_gpus(stage, gas) -> None:
    # fp16 on GPUs: the overflow at step 5 is found at the end of backward (gas 1) or only
    # at the step, after its speculative weights were published (stage 2, gas 2).
    world = min(2, torch.cuda.device_count())
    results = run_distributed(
        _side_by_side, world, stage, "fp16", gas, 1.0, FP16_CLIPS, 5, backend="nccl", timeout=300
    )
    expected = dict(FP16_EXPECTED, cancelled=0 if stage == 2 and gas > 1 else 2)
    for result in results:
        on, off = result["on"], result["off"]
        assert on["speculative"] and on["stats"] == expected
        assert on["skipped"] == off["skipped"] == 1 and on["scales"] == off["scales"]
        assert result["first_difference"] is None, result["first_difference"]


def _step_reads_no_host_gradients() -> dict:
    """bf16 with its non-finite check (on by default) and a kept speculative step: engine.step()
    neither votes over the host gradients (a pass as long as a CPU step: the regression of
    2026-11-25, step phase ~350 ms at 1.3b) nor steps on the CPU again."""
    import slipstream
    import slipstream.zero.optimizer as zero_optimizer
    from slipstream.zero.testing import TinyTransformer, batch_for

    calls = {"host_vote": 0, "host_step": 0}
    original_vote = zero_optimizer.overflow_on_any_rank

    def counting_vote(*args: object, **kwargs: object) -> bool:
        calls["host_vote"] += 1
        return original_vote(*args, **kwargs)

    zero_optimizer.overflow_on_any_rank = counting_vote
    torch.manual_seed(0)
    model = TinyTransformer()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": KEEP,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 600,
            "offload_optimizer": {"device": "cpu"},
        },
    }
    engine, *_ = slipstream.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config
    )
    host = engine.zero.optimizer.offload.host
    original_step = host.step_params

    def counting_step(*args: object, **kwargs: object) -> None:
        calls["host_step"] += 1
        original_step(*args, **kwargs)

    host.step_params = counting_step
    for step in range(3):
        ids, labels = batch_for(step, 0, MICRO)
        engine.backward(engine(ids, labels))
        engine.step()
    stats = engine.zero.optimizer.offload.speculation
    return {**calls, "kept": stats.kept, "check": engine._check_nonfinite}


def test_a_kept_speculative_step_reads_no_host_gradients_in_step() -> None:
    (result,) = run_distributed(_step_reads_no_host_gradients, 1, timeout=300)
    assert result["check"] and result["kept"] == 3
    assert result["host_vote"] == 0 and result["host_step"] == 0, result


def _accumulated_vote(poison_at: int) -> dict:
    """Stage 2, gradient accumulation 2, bf16 with its non-finite check, CPU offload: the vote
    of each step rides on the device sums of squares of its two reductions (no pass over the
    host gradients), and an inf gradient in one micro-step (``poison_at``, on the last rank
    only) skips that step on every rank, leaving weights and Adam states as they were."""
    import slipstream
    import slipstream.zero.optimizer as zero_optimizer
    from slipstream import comm
    from slipstream.zero.testing import TinyTransformer, batch_for

    calls = {"host_vote": 0}
    original_vote = zero_optimizer.overflow_on_any_rank

    def counting_vote(*args: object, **kwargs: object) -> bool:
        calls["host_vote"] += 1
        return original_vote(*args, **kwargs)

    zero_optimizer.overflow_on_any_rank = counting_vote
    world, rank = comm.get_world_size(), comm.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": KEEP,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 600,
            "offload_optimizer": {"device": "cpu"},
        },
    }
    engine, *_ = slipstream.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.01), config=config
    )
    unchanged = []
    for micro in range(6):
        if micro == poison_at - poison_at % 2:  # the first micro-step of the poisoned step
            engine.wait_for_step()
            weights = [p.detach().clone() for p in engine.module.parameters()]
            states = [
                v.clone()
                for s in engine.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            ]
        ids, labels = batch_for(micro, rank, MICRO)
        loss = engine(ids, labels)
        if micro == poison_at and rank == world - 1:
            weight = engine.module.block.qkv.weight
            loss = loss + torch.sqrt(weight.float().sum() * 0.0)  # a nan gradient
        engine.backward(loss)
        engine.step()
        if micro == poison_at + (1 - poison_at % 2):  # the poisoned step's boundary
            engine.wait_for_step()
            after = [
                v
                for s in engine.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            ]
            unchanged.append(
                all(torch.equal(w, p) for w, p in zip(weights, engine.module.parameters()))
                and len(states) == len(after)
                and all(torch.equal(b, a) for b, a in zip(states, after))
            )
    finite = all(bool(torch.isfinite(p).all()) for p in engine.module.parameters())
    return {
        **calls,
        "skipped": engine.nonfinite_skipped_steps,
        "unchanged": unchanged,
        "finite": finite,
        "steps": engine.global_steps,
    }


def _accumulated_votes() -> list[dict]:
    # The first and the second micro-step of the second step poisoned, in one world.
    return [_accumulated_vote(2), _accumulated_vote(3)]


def test_accumulated_offload_votes_on_device_squares() -> None:
    for results in run_distributed(_accumulated_votes, 2, timeout=300):
        for result in results:
            assert result["host_vote"] == 0, result
            assert result["skipped"] == 1 and result["unchanged"] == [True], result
            assert result["finite"] and result["steps"] == 3, result
