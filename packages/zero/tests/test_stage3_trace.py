"""ExecutionTrace's prefetch budget and reuse distance, on stand-in units (no process group)."""

from __future__ import annotations

import torch

from slipstream.zero.stage3.trace import ExecutionTrace


class _Unit:
    """What the trace reads of a ParamUnit: its size, whether it is gathered or prefetched."""

    def __init__(self, name: str, numel: int) -> None:
        self.name, self.numel = name, numel
        self.prefetch_hold = False
        self.gathered = False

    def sharded_numel(self) -> int:
        return 0 if self.gathered or self.prefetch_hold else self.numel


def _recorded(sizes: list[int], **budget: int) -> tuple[ExecutionTrace, list[_Unit]]:
    units = [_Unit(f"u{i}", n) for i, n in enumerate(sizes)]
    trace = ExecutionTrace(
        budget.get("prefetch", 50), budget.get("live", 10**9), budget.get("reuse", 0)
    )
    trace.begin_iteration()
    for unit in units:
        assert trace.on_forward(unit, 0) == []
    trace.finish_recording()
    return trace, units


def _forward(trace: ExecutionTrace, units: list[_Unit]) -> tuple[list[int], set[str]]:
    """One forward along the recording: the elements prefetched ahead after each hook, and
    the units whose use found them prefetched."""
    trace.begin_iteration()
    peaks, ready = [], set()
    for unit in units:
        if unit.prefetch_hold:
            ready.add(unit.name)
        unit.prefetch_hold = False  # the use adopts its prefetch
        for chosen in trace.on_forward(unit, 0):
            chosen.prefetch_hold = True
        peaks.append(sum(u.numel for u in units if u.prefetch_hold))
    return peaks, ready


def test_prefetch_counts_what_is_already_ahead_and_takes_the_unit_crossing_the_budget() -> None:
    # A 7B block's shape in miniature: qkv, o, up (larger than the budget), down.
    sizes = [50, 17, 90, 45] * 8
    trace, units = _recorded(sizes, prefetch=50)
    trace.begin_iteration()
    first = trace.on_forward(units[0], 0)
    assert [u.name for u in first] == ["u1", "u2"]  # 17 < 50 ahead, so the 90 is taken too
    for unit in first:
        unit.prefetch_hold = False
    peaks, ready = _forward(trace, units)
    # Never more ahead than the budget plus one unit (before: a fresh budget per hook, so
    # the prefetch ran away to max_live_numel), and every unit but the first was prefetched
    # before its use, the ones larger than the budget included.
    assert max(peaks) < 50 + max(sizes)
    assert ready == {u.name for u in units[1:]}


def test_zero_budget_prefetches_nothing() -> None:
    trace, units = _recorded([30, 120, 10], prefetch=0)
    peaks, ready = _forward(trace, units)
    assert peaks == [0, 0, 0] and ready == set()


def test_prefetch_stops_at_max_live_numel() -> None:
    trace, units = _recorded([10, 40, 40, 40], prefetch=1000, live=60)
    trace.begin_iteration()
    assert [u.name for u in trace.on_forward(units[0], 10)] == ["u1"]  # 10 + 40 <= 60 < 90
    assert trace.on_forward(units[1], lambda: 60) == []  # counted lazily, only when needed


def test_backward_walks_the_recording_in_reverse() -> None:
    trace, units = _recorded([10, 20, 30, 40], prefetch=25)
    chosen = trace.on_backward(units[3], 0)
    assert [u.name for u in chosen] == ["u2"]  # 30 crosses 25: taken, then the budget is spent
    chosen[0].prefetch_hold = True
    units[1].prefetch_hold = True  # in flight already: counts as ahead
    assert trace.on_backward(units[3], 0) == []
    units[1].prefetch_hold = False
    units[2].prefetch_hold = False  # u2's backward adopted its prefetch
    assert [u.name for u in trace.on_backward(units[2], 0)] == ["u1", "u0"]


def test_reused_soon_matches_the_reuse_distance() -> None:
    # u0 is called again after u1 (20) and u2 (30): 50 elements in between.
    sizes = [10, 20, 30]
    units = [_Unit(f"u{i}", n) for i, n in enumerate(sizes)]
    order = [units[0], units[1], units[2], units[0]]
    for reuse, expected in ((49, False), (50, True), (0, False)):
        trace = ExecutionTrace(0, 10**9, reuse)
        trace.begin_iteration()
        for unit in order:
            trace.on_forward(unit, 0)
        trace.finish_recording()
        trace.begin_iteration()
        trace.on_forward(units[0], 0)
        assert trace.reused_soon(units[0]) is expected, reuse
        for unit in order[1:3]:
            trace.on_forward(unit, 0)
        trace.on_forward(units[0], 0)
        assert trace.reused_soon(units[0]) is False  # its last call


def test_the_models_live_count_follows_every_gather_and_release() -> None:
    # The count the prefetch checks max_live_numel against is kept by the parameters' state
    # changes; it must equal a walk over the units at every hook (tied, frozen, reused and
    # persistent parameters included), one process.
    from slipstream.zero import ZeroSettings, shard_parameters
    from slipstream.zero.testing import TinyTransformer, batch_for

    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, dim=16, unused=True)
    settings = ZeroSettings(stage=3, prefetch_numel=600, param_persistence_numel=40)
    sharded = shard_parameters(model, settings)
    zero = sharded.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    checked = []

    def check(*_: object) -> None:
        checked.append(sharded._live_numel() == ExecutionTrace.live_numel(sharded.units))

    for unit in sharded.units:
        unit.module.register_forward_pre_hook(check)
        unit.module.register_forward_hook(check)
    for p in zero.params:
        p.register_post_accumulate_grad_hook(check)
    for step in range(3):
        model(*batch_for(step, 0, 2)).backward()
        zero.finish_backward()
        check()
        zero.optimizer.step()
        zero.zero_grad()
        check()
    assert checked and all(checked)


def _leaf_against_per_module() -> dict:
    """Three stage-3 steps of the tiny model over the spawned world, with the blocks as leaf
    modules and without: the losses and final master shards of each."""
    from slipstream.zero import ZeroSettings, shard_parameters
    from slipstream.zero.testing import TinyTransformer, batch_for

    out = {}
    for leaf in ((), ("_Block",)):
        torch.manual_seed(0)
        model = TinyTransformer(unused=True)
        settings = ZeroSettings(
            stage=3, prefetch_numel=2000, param_persistence_numel=0, leaf_module_classes=leaf
        )
        sharded = shard_parameters(model, settings)
        zero = sharded.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
        losses = []
        for step in range(3):
            loss = model(*batch_for(step, sharded.group.rank, 2))
            loss.backward()
            zero.finish_backward()
            zero.step(max_grad_norm=0.5)
            zero.zero_grad()
            losses.append(loss.item())
        out[leaf] = {
            "units": [u.name for u in sharded.units],
            "losses": losses,
            "masters": [m.detach().clone() for m in zero.masters.masters],
        }
    return out


def test_leaf_modules_gather_a_subtree_as_one_unit_with_the_same_training() -> None:
    from slipstream.comm.testing import run_distributed

    for result in run_distributed(_leaf_against_per_module, 2, timeout=300):
        plain, leaf = result[()], result[("_Block",)]
        # The blocks (called once and twice) are one unit each, their submodules none.
        assert "block" in leaf["units"] and "shared" in leaf["units"]
        assert not any(name.startswith(("block.", "shared.")) for name in leaf["units"])
        assert any(name.startswith("block.") for name in plain["units"])
        # The same arithmetic (fp32): the grouping changes only which gathers run together.
        assert leaf["losses"] == plain["losses"]
        for a, b in zip(leaf["masters"], plain["masters"], strict=True):
            assert torch.equal(a, b)
