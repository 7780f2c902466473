"""The GradientPath interface in one process: every stage implements it; state round-trips."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream.zero import (
    GatheredParameters,
    GradientPath,
    ReduceSettings,
    ReplicatedGradientPath,
    ShardedOptimizerStates,
    ZeroSettings,
    shard_parameters,
)
from slipstream.zero.settings import stage3_reduce_bucket_numel
from slipstream.zero.testing import TinyTransformer, batch_for


def _path(stage: int, model: nn.Module, fused: bool = False) -> GradientPath:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if stage == 0:
        optimizer = torch.optim.AdamW(trainable, lr=0.01, fused=fused)
        return ReplicatedGradientPath(trainable, optimizer, ReduceSettings(bucket_numel=64))
    settings = ZeroSettings(stage=stage, reduce_bucket_numel=64)
    if stage == 3:
        sharded = shard_parameters(model, settings)
        optimizer = torch.optim.AdamW(trainable, lr=0.01, fused=fused)
        return sharded.attach_optimizer(optimizer)  # type: ignore[no-any-return]
    optimizer = torch.optim.AdamW(trainable, lr=0.01, fused=fused)
    return ShardedOptimizerStates(list(model.parameters()), optimizer, settings)


def _train(model: nn.Module, path: GradientPath, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids, labels = batch_for(step, 0, 2)
        loss = model(ids, labels)
        path.prepare_backward(True)
        loss.backward()
        path.finish_backward(True)
        outcome = path.step(max_grad_norm=0.5, nonfinite_check=loss.detach())
        assert not outcome.overflow
        path.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_dict_round_trip_continues_the_run(stage: int) -> None:
    torch.manual_seed(0)
    base = TinyTransformer()
    straight, resumed = copy.deepcopy(base), copy.deepcopy(base)
    path = _path(stage, straight)
    assert isinstance(path, GradientPath)
    expected = _train(straight, path, range(4))

    other = _path(stage, resumed)
    _train(resumed, other, range(2))
    saved = copy.deepcopy(other.state_dict())
    _train(resumed, other, range(2, 3))  # drifts away, then the load brings it back
    other.load_state_dict(saved)
    assert _train(resumed, other, range(2, 4)) == expected[2:]

    report = path.memory_report()
    masters = sum(v for k, v in report.items() if k.startswith("masters_"))
    states = sum(v for k, v in report.items() if k.startswith("optimizer_states_"))
    trainable = sum(p.numel() for p in base.parameters() if p.requires_grad)  # tied once
    assert masters == 4 * trainable  # one rank: the shard is the whole (tied once)
    assert states == 2 * masters  # AdamW's two moments
    assert report["reduce_buckets_live"] == 0  # between steps


def test_a_nonfinite_loss_skips_the_step_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    path = _path(3, model)
    with GatheredParameters(list(model.parameters())):
        before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, labels = batch_for(0, 0, 2)
    loss = model(ids, labels)
    path.prepare_backward(True)
    loss.backward()
    path.finish_backward(True)
    outcome = path.step(nonfinite_check=torch.tensor(float("nan")))
    assert outcome.overflow and outcome.grad_norm is None
    path.zero_grad()
    with GatheredParameters(list(model.parameters())):
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_skip_decided_on_the_device_changes_nothing(stage: int) -> None:
    """defer_skip with a fused optimizer: the step runs, the kernels skip on the flag."""
    torch.manual_seed(0)
    model = TinyTransformer()
    path = _path(stage, model, fused=True)
    for step, check in enumerate([0.0, float("inf")]):  # a taken step, then a skipped one
        with GatheredParameters(list(model.parameters())):
            before = {k: v.clone() for k, v in model.state_dict().items()}
        states = [v.clone() for s in path.optimizer.state.values() for v in s.values()]
        ids, labels = batch_for(step, 0, 2)
        loss = model(ids, labels)
        path.prepare_backward(True)
        loss.backward()
        path.finish_backward(True)
        outcome = path.step(
            max_grad_norm=0.5, nonfinite_check=loss.detach() + check, defer_skip=True
        )
        path.zero_grad()
        assert not outcome.overflow and outcome.skipped is not None
        assert float(outcome.skipped) == (1.0 if check else 0.0)
        after = [v for s in path.optimizer.state.values() for v in s.values()]
        with GatheredParameters(list(model.parameters())):
            same = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert same == bool(check)  # the taken step moved the weights, the skipped one not
        if check:
            assert all(torch.equal(a, b) for a, b in zip(after, states))


def test_stage3_bucket_is_capped_by_the_model() -> None:
    settings = ZeroSettings(stage=3, reduce_bucket_numel=500_000_000)
    numels = [1000] * 6400  # 6.4e6 elements: 1/64 is 1e5
    assert stage3_reduce_bucket_numel(settings, numels) == 100_000
    assert stage3_reduce_bucket_numel(settings, [*numels, 300_000]) == 300_000  # largest wins
    off = ZeroSettings(stage=3, reduce_bucket_numel=5000, stage3_reduce_bucket_parts=0)
    assert stage3_reduce_bucket_numel(off, numels) == 5000
    small = ZeroSettings(stage=3, reduce_bucket_numel=5000)
    assert stage3_reduce_bucket_numel(small, numels) == 5000  # reduce_bucket_size is smaller
    with pytest.raises(ValueError, match="stage3_reduce_bucket_parts"):
        ZeroSettings(stage=3, stage3_reduce_bucket_parts=-1)


def test_stage0_masters_load_from_the_model_or_the_state() -> None:
    """What a checkpoint's stage-0 load relies on: ``masters`` None refreshes the fp32
    masters from the (already loaded) model and keeps the optimizer state; given masters
    are published into the low-precision model."""
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.01)
    path = ReplicatedGradientPath(
        trainable, optimizer, ReduceSettings(bucket_numel=64), masters=True
    )
    _train(model, path, range(1))
    saved = copy.deepcopy(path.state_dict())
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    with torch.no_grad():  # as a checkpoint's model file would: other low-precision weights
        for param in trainable:
            param.mul_(0.5)
    path.load_state_dict({"masters": None, "optimizer": {}})
    assert path.masters is not None
    for param, master in zip(trainable, path.masters.masters):
        assert master.dtype == torch.float32 and master.equal(param.float())
    assert all(s["exp_avg"].equal(m) for s, m in zip(optimizer.state.values(), moments))
    path.load_state_dict(saved)
    for param, master, value in zip(trainable, path.masters.masters, saved["masters"]):
        assert master.equal(value) and param.equal(value.to(torch.bfloat16))


@pytest.mark.parametrize("vote", [False, True])
def test_a_fused_optimizer_clips_inside_its_step(
    vote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: clipping inside the fused step]: with a fused optimizer the clip factor goes in
    as ``grad_scale`` (no pass over the gradients before the step); the update and the
    clipped gradients match torch's clip_grad_norm_ + step to fp32 rounding."""
    from slipstream.zero import optimizer as zero_optimizer
    from slipstream.zero.group import DataParallelGroup

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (37, 100, 5)]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, reference):
        p.grad = torch.randn_like(p) * 3.0
        q.grad = p.grad.clone()
    fused = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=True)
    plain = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.01, fused=True)

    def no_pass(*args: object, **kwargs: object) -> None:
        raise AssertionError("the gradients were scaled by a pass before the fused step")

    monkeypatch.setattr(zero_optimizer, "clip_grads_", no_pass)
    outcome = zero_optimizer.take_sharded_step(
        fused,
        [p.grad for p in params],  # type: ignore[misc]
        DataParallelGroup.of(),
        torch.device("cpu"),
        max_grad_norm=0.5,
        nonfinite_check=torch.zeros(()) if vote else None,
        defer_skip=vote,
    )
    norm = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    plain.step()
    assert outcome.grad_norm is not None
    torch.testing.assert_close(outcome.grad_norm, norm, rtol=1e-6, atol=0)
    assert (outcome.skipped is not None) == vote
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert not hasattr(fused, "grad_scale") and not hasattr(fused, "found_inf")


@pytest.mark.parametrize("fused", [False, True])
def test_a_phased_step_equals_one_step_and_publishes_each_phase_after_it(fused: bool) -> None:
    """PhasedPublish: the optimizer steps one phase's parameters at a time (two parameter
    groups, one phase holding none of the second group's) and each phase is published right
    after its step; the result is the single step's bit for bit."""
    from slipstream.zero.group import DataParallelGroup
    from slipstream.zero.optimizer import PhasedPublish, take_sharded_step

    torch.manual_seed(0)
    sizes = (37, 100, 5, 64)
    params = [nn.Parameter(torch.randn(n)) for n in sizes]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()

    def build(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
        groups = [{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "lr": 0.02}]
        return torch.optim.AdamW(groups, lr=0.01, fused=fused)

    phased_opt, plain_opt = build(params), build(twins)
    initial = [p.detach().clone() for p in params]
    events: list[str] = []
    seen: list[list[torch.Tensor]] = []

    def publish(phase: int) -> None:
        events.append(f"publish {phase}")
        seen.append([p.detach().clone() for p in params])

    phased = PhasedPublish(
        phases=[[0], [1, 2], [3]],
        begin=lambda: events.append("begin"),
        publish=publish,
        end=lambda: events.append("end"),
    )
    group = DataParallelGroup.of()
    for _ in range(2):
        common = dict(max_grad_norm=0.5, nonfinite_check=torch.zeros(()), defer_skip=True)
        take_sharded_step(
            phased_opt,
            [p.grad for p in params],  # type: ignore[misc]
            group,
            torch.device("cpu"),
            phased=phased,
            masters=params,
            **common,  # type: ignore[arg-type]
        )
        take_sharded_step(
            plain_opt,
            [q.grad for q in twins],  # type: ignore[misc]
            group,
            torch.device("cpu"),
            **common,  # type: ignore[arg-type]
        )
        for p, q in zip(params, twins):
            assert torch.equal(p.detach(), q.detach())
    assert events == ["begin", "publish 0", "publish 1", "publish 2", "end"] * 2
    # When phase 0 was published, parameter 0 had stepped and parameter 1 not yet.
    assert not torch.equal(seen[0][0], initial[0]) and torch.equal(seen[0][1], initial[1])
    assert [len(g["params"]) for g in phased_opt.param_groups] == [3, 1]
    assert torch.equal(seen[1][0], seen[2][0])  # parameter 0 did not move after its phase
