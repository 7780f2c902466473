"""The functional API in one process (a group of one): layout, buckets, stages vs plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream.zero import (
    GatheredParameters,
    ShardedOptimizerStates,
    ShardSpec,
    ZeroSettings,
    shard_parameters,
    sharded_state_of,
)
from slipstream.zero.grad_reduce import plan_buckets
from slipstream.zero.param_gather import plan_gather_buckets
from slipstream.zero.stage3 import ShardState
from slipstream.zero.testing import TinyTransformer, batch_for


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: intra-op threads only contend on the shared 2-core CI machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_shard_spec_pads_and_covers_every_element() -> None:
    spec = ShardSpec(torch.Size([5, 3]), world_size=4)
    assert (spec.numel, spec.shard_numel, spec.padded_numel) == (15, 4, 16)
    full = torch.arange(15.0).view(5, 3)
    shards = [spec.shard_of(full, r) for r in range(4)]
    assert torch.equal(torch.cat(shards)[:15], full.reshape(-1))
    assert shards[3].tolist() == [12.0, 13.0, 14.0, 0.0]
    assert spec.valid_range(3) == (12, 15)
    assert ShardSpec(torch.Size([]), 8).shard_numel == 1  # a scalar parameter


def test_buckets_respect_the_size_and_run_in_reverse_order() -> None:
    specs = [ShardSpec(torch.Size([n]), 2) for n in (10, 10, 30, 4)]
    assert plan_buckets(specs, 24) == [[3], [2], [1, 0]]  # 30 > 24 travels alone
    assert plan_buckets(specs, 40) == [[3, 2], [1, 0]]
    assert plan_buckets(specs, 1) == [[3], [2], [1], [0]]


def test_buckets_keep_offloaded_and_device_masters_apart() -> None:
    specs = [ShardSpec(torch.Size([n]), 2) for n in (10, 10, 30, 4)]
    apart = [False, False, True, True]
    assert plan_buckets(specs, 100, apart) == [[3, 2], [1, 0]]
    assert plan_gather_buckets(specs, 100, apart) == [[0, 1], [2, 3]]
    assert plan_gather_buckets(specs, 100) == [[0, 1, 2, 3]]


def test_partial_offload_keeps_a_leading_share_on_the_device() -> None:
    pytest.importorskip("slipstream.offload")
    from slipstream.zero.offload import offloaded_flags

    numels = [10, 20, 30, 40]
    assert offloaded_flags(numels, 1.0) == [True] * 4
    assert offloaded_flags(numels, 0.0) == [False] * 4
    assert offloaded_flags(numels, 0.7) == [False, False, True, True]  # 30 of 100 stay
    assert offloaded_flags(numels, 0.75) == [False, True, True, True]  # 25: only the first
    assert offloaded_flags([50, 1, 49], 0.5) == [False, True, True]  # a prefix, no gaps
    assert offloaded_flags([0, 5], 1.0) == [True, True]


def test_settings_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="stage=0"):
        ZeroSettings(stage=0)
    with pytest.raises(ValueError, match="reduce_bucket_numel=0 must be >= 1"):
        ZeroSettings(stage=2, reduce_bucket_numel=0)


def _train(stage: int, steps: int = 2) -> tuple[list[float], list[float], nn.Module]:
    torch.manual_seed(0)
    model = TinyTransformer(unused=True)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.01)
    settings = ZeroSettings(stage=stage, reduce_bucket_numel=500, param_persistence_numel=64)
    if stage == 3:
        zero = shard_parameters(model, settings).attach_optimizer(optimizer)
    else:
        zero = ShardedOptimizerStates(list(model.parameters()), optimizer, settings)
    losses, ref_losses = [], []
    for step in range(steps):
        for micro in range(2):  # gradient accumulation over two micro-steps
            ids, labels = batch_for(step, micro, 2)
            zero.prepare_backward(is_boundary=micro == 1)
            loss = model(ids, labels)
            (loss / 2).backward()
            zero.finish_backward(is_boundary=micro == 1)
            ref_loss = reference(ids, labels)
            (ref_loss / 2).backward()
            losses.append(float(loss.detach()))
            ref_losses.append(float(ref_loss.detach()))
        zero.optimizer.step(max_grad_norm=0.5)
        zero.zero_grad()
        # The reference reduces zeros for the unused layer too, as ZeRO does.
        for p in reference.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    return losses, ref_losses, reference, model  # type: ignore[return-value]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_plain_pytorch_in_one_process(stage: int) -> None:
    losses, ref_losses, reference, model = _train(stage)
    for ours, ref in zip(losses, ref_losses, strict=True):
        assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref))
    with GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
    if stage == 3:
        # Released after the block, except persistent (small) ones, valid until the next step.
        states = [sharded_state_of(p) for p in model.parameters()]
        assert all(s.state is ShardState.SHARDED for s in states if not s.persistent)
        assert any(s.persistent for s in states) and any(not s.persistent for s in states)


def test_stage3_frees_parameters_between_modules() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    seen: list[list[int]] = []

    def probe(module: nn.Module, args: object, output: object) -> None:
        seen.append([p.untyped_storage().nbytes() for p in model.parameters()])

    model[1].register_forward_hook(probe)
    sharded = shard_parameters(model, ZeroSettings(stage=3, param_persistence_numel=0))
    model(torch.randn(2, 8))
    # While the Tanh runs, the first Linear is released and the second not yet gathered.
    assert seen == [[0, 0, 0, 0]]
    assert len(sharded.units) == 2


def test_stage3_refuses_two_parameters_sharing_storage() -> None:
    model = nn.Module()
    base = torch.randn(4, 4)
    model.a = nn.Parameter(base)
    model.b = nn.Parameter(base.view(16))
    with pytest.raises(ValueError, match="share storage but are different"):
        shard_parameters(model, ZeroSettings(stage=3))


def test_optimizer_that_already_stepped_is_refused() -> None:
    layer = nn.Linear(3, 3)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.randn(1, 3)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already holds state"):
        ShardedOptimizerStates(list(layer.parameters()), optimizer, ZeroSettings(stage=1))


def test_gathered_parameters_edits_reach_the_shard_and_master() -> None:
    layer = nn.Linear(4, 4)
    sharded = shard_parameters(layer, ZeroSettings(stage=3, param_persistence_numel=0))
    path = sharded.attach_optimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
    with GatheredParameters(layer.weight, modifier_rank=0):
        with torch.no_grad():
            layer.weight.fill_(2.0)
    assert torch.all(sharded_state_of(layer.weight).shard == 2.0)
    assert torch.all(path.masters.masters[0] == 2.0)
    with GatheredParameters(layer.bias):
        expected = 8.0 + layer.bias.detach().clone()  # ones(4) . a row of 2s = 8
    assert torch.allclose(layer(torch.ones(1, 4)), expected)


def _count_gathers(
    settings: ZeroSettings, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[int, bool]]:
    """(parameters, async) of every all-gather over three training steps of the tiny model."""
    from slipstream.zero.stage3 import sharded_param

    calls: list[tuple[int, bool]] = []
    original = sharded_param.PendingGather.__init__

    def counting(self, members, async_op):  # type: ignore[no-untyped-def]
        calls.append((len(members), async_op))
        original(self, members, async_op)

    monkeypatch.setattr(sharded_param.PendingGather, "__init__", counting)
    torch.manual_seed(0)
    model = TinyTransformer()
    zero = shard_parameters(model, settings).attach_optimizer(torch.optim.SGD(model.parameters()))
    for step in range(3):
        model(*batch_for(step, 0, 2)).backward()
        zero.finish_backward()
        zero.optimizer.step()
        zero.zero_grad()
    return calls


def test_prefetch_persistence_and_reuse_change_the_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    bare = dict(prefetch_numel=0, max_reuse_numel=0, param_persistence_numel=0)
    plain = _count_gathers(ZeroSettings(stage=3, **bare), monkeypatch)
    assert plain and not any(is_async for _, is_async in plain)
    # Prefetch: after the first (recorded) forward, later units arrive by async gathers.
    prefetched = _count_gathers(
        ZeroSettings(stage=3, **{**bare, "prefetch_numel": 10**6}), monkeypatch
    )
    assert any(is_async for _, is_async in prefetched)
    # Reuse distance: the module called twice in a row keeps its parameters in between.
    reused = _count_gathers(
        ZeroSettings(stage=3, **{**bare, "max_reuse_numel": 10**6}), monkeypatch
    )
    assert len(reused) < len(plain)
    # Persistence: everything small stays gathered until the step: one gather per unit per step.
    persistent = _count_gathers(
        ZeroSettings(stage=3, **{**bare, "param_persistence_numel": 10**6}), monkeypatch
    )
    assert len(persistent) < len(reused)
