"""DeepSpeed LR schedules against their closed forms, written out here independently."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slipstream.kernels.config_schema import ConfigError
from slipstream.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    ScheduleParamError,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
    resolve_scheduler,
)

STEPS = [0, 1, 2, 3, 5, 8, 9, 10, 11, 15, 19, 20, 21, 29, 30, 31, 45, 60, 100]


def sgd(lr: float = 1.0, groups: int = 1, momentum: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)],
        lr=lr,
        momentum=momentum,
    )


def lr_at(schedule, optimizer, i: int) -> list[float]:
    schedule.step(i)
    return [group["lr"] for group in optimizer.param_groups]


def block(type_: str, **params: object) -> SimpleNamespace:
    return SimpleNamespace(type=type_, params=params)


# ---------------------------------------------------------------- closed forms
def warmup_closed_form(i: int, lo: float, hi: float, n: int, kind: str) -> float:
    w = max(2, n)
    if i < 0:
        return lo
    if i >= w:
        return hi
    frac = math.log(i + 1) / math.log(w) if kind == "log" else i / w
    return lo + (hi - lo) * frac


def warmup_decay_closed_form(i: int, lo: float, hi: float, n: int, total: int, kind: str) -> float:
    w = max(2, n)
    if i < w:
        return warmup_closed_form(i, lo, hi, n, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - w))


def cosine_closed_form(
    i: int, base: float, n: int, total: int, min_ratio: float, cos_min: float, kind: str
) -> float:
    w = max(2, n)
    if i < 0:
        return 0.0
    if i < w:
        frac = math.log(i + 1) / math.log(w) if kind == "log" else i / w
        return base * (min_ratio + (1 - min_ratio) * frac)
    progress = min(1.0, (i - w + 1) / max(1, total - w))
    return base * max(0.0, cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def range_test_closed_form(i: int, lo: float, size: int, rate: float, staircase: bool) -> float:
    interval = (i + 1) / size
    return lo * (1 + rate * (math.floor(interval) if staircase else interval))


# ---------------------------------------------------------------- WarmupLR
def test_warmup_lr_hand_values() -> None:
    opt = sgd()
    linear = WarmupLR(
        opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear"
    )
    assert opt.param_groups[0]["lr"] == 0.0  # set at construction
    assert lr_at(linear, opt, 5) == [0.5]
    assert lr_at(linear, opt, 10) == [1.0]
    log = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)
    assert lr_at(log, opt, 0) == [0.0]
    assert lr_at(log, opt, 9) == [pytest.approx(1.0)]
    assert lr_at(log, opt, 3) == [pytest.approx(math.log(4) / math.log(10))]


@pytest.mark.parametrize("kind", ["log", "linear"])
@pytest.mark.parametrize("n", [0, 1, 10])
def test_warmup_lr_matches_closed_form(kind: str, n: int) -> None:
    opt = sgd()
    schedule = WarmupLR(
        opt, warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=n, warmup_type=kind
    )
    for i in STEPS:
        assert lr_at(schedule, opt, i) == [
            pytest.approx(warmup_closed_form(i, 0.001, 0.1, n, kind), rel=1e-12)
        ]


def test_warmup_lr_steps_one_batch_at_a_time_and_reports_last_lr() -> None:
    opt = sgd()
    schedule = WarmupLR(opt, warmup_max_lr=0.2, warmup_num_steps=20)
    for i in range(40):
        schedule.step()
        expected = warmup_closed_form(i, 0.0, 0.2, 20, "log")
        assert schedule.get_last_lr() == [pytest.approx(expected, rel=1e-12)]
        assert schedule.get_lr() == schedule.get_last_lr()


def test_warmup_lr_max_defaults_to_each_groups_lr_and_takes_lists() -> None:
    groups: list[dict[str, Any]] = [
        {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.4},
        {"params": [torch.nn.Parameter(torch.zeros(1))]},
    ]
    opt = torch.optim.SGD(groups, lr=0.1)
    schedule = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    assert lr_at(schedule, opt, 2) == [pytest.approx(0.2), pytest.approx(0.05)]
    opt = sgd(groups=2)
    schedule = WarmupLR(
        opt,
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=[1.0, 0.5],
        warmup_num_steps=4,
        warmup_type="linear",
    )
    assert opt.param_groups[1]["lr"] == 0.1
    assert lr_at(schedule, opt, 1) == [pytest.approx(0.25), pytest.approx(0.2)]
    with pytest.raises(ScheduleParamError, match="warmup_max_lr"):
        WarmupLR(opt, warmup_max_lr=[1.0, 2.0, 3.0])


def test_tensor_lr_is_updated_in_place() -> None:
    lr = torch.tensor(0.5)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    schedule.step(4)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.4)


# ---------------------------------------------------------------- WarmupDecayLR
def test_warmup_decay_hand_values() -> None:
    opt = sgd()
    schedule = WarmupDecayLR(
        opt, total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear"
    )
    assert lr_at(schedule, opt, 5) == [0.5]
    assert lr_at(schedule, opt, 10) == [1.0]
    assert lr_at(schedule, opt, 15) == [0.5]
    assert lr_at(schedule, opt, 20) == [0.0]
    assert lr_at(schedule, opt, 25) == [0.0]


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_matches_closed_form(kind: str) -> None:
    opt = sgd()
    schedule = WarmupDecayLR(
        opt,
        total_num_steps=30,
        warmup_min_lr=0.01,
        warmup_max_lr=0.2,
        warmup_num_steps=10,
        warmup_type=kind,
    )
    for i in STEPS:
        expected = warmup_decay_closed_form(i, 0.01, 0.2, 10, 30, kind)
        assert lr_at(schedule, opt, i) == [pytest.approx(expected, rel=1e-12, abs=1e-15)]
    # warmup_max_lr keeps DeepSpeed's 0.001 default for this schedule.
    assert WarmupDecayLR(sgd(), total_num_steps=10, warmup_num_steps=2).max_lrs == [0.001]


# ---------------------------------------------------------------- WarmupCosineLR
def test_warmup_cosine_hand_values() -> None:
    opt = sgd(lr=1.0)
    schedule = WarmupCosineLR(
        opt, total_num_steps=20, warmup_num_steps=10, cos_min_ratio=0.1, warmup_type="linear"
    )
    assert opt.param_groups[0]["lr"] == 0.0  # 0 until the first step, as in DeepSpeed
    assert lr_at(schedule, opt, 5) == [0.5]
    assert lr_at(schedule, opt, 14) == [pytest.approx(0.55)]  # cosine half way: 0.1 + 0.9 * 0.5
    assert lr_at(schedule, opt, 19) == [pytest.approx(0.1)]
    assert lr_at(schedule, opt, 50) == [pytest.approx(0.1)]  # held at the floor past the end


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_matches_closed_form(kind: str) -> None:
    opt = sgd(lr=0.3, groups=2)
    opt.param_groups[1]["lr"] = 0.03
    schedule = WarmupCosineLR(
        opt,
        total_num_steps=30,
        warmup_min_ratio=0.05,
        warmup_num_steps=10,
        cos_min_ratio=0.01,
        warmup_type=kind,
    )
    for i in STEPS:
        expected = [cosine_closed_form(i, base, 10, 30, 0.05, 0.01, kind) for base in (0.3, 0.03)]
        assert lr_at(schedule, opt, i) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- LRRangeTest
def test_lr_range_test() -> None:
    opt = sgd()
    schedule = LRRangeTest(
        opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=10, lr_range_test_step_rate=2.0
    )
    assert opt.param_groups[0]["lr"] == 0.01
    assert lr_at(schedule, opt, 4) == [pytest.approx(0.02)]
    stairs = LRRangeTest(opt, 0.01, 10, 2.0, lr_range_test_staircase=True)
    assert lr_at(stairs, opt, 4) == [0.01]
    assert lr_at(stairs, opt, 9) == [pytest.approx(0.03)]
    for staircase in (False, True):
        schedule = LRRangeTest(opt, 0.005, 7, 0.5, staircase)
        for i in STEPS:
            assert lr_at(schedule, opt, i) == [
                pytest.approx(range_test_closed_form(i, 0.005, 7, 0.5, staircase), rel=1e-12)
            ]


# ---------------------------------------------------------------- OneCycle
def test_one_cycle_hand_values_with_momentum() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], betas=(0.5, 0.999))
    schedule = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        decay_lr_rate=0.5,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.1,
    )
    group = opt.param_groups[0]
    assert group["lr"] == 0.1 and group["betas"] == (
        0.8,
        0.999,
    )  # construction: min lr, min momentum
    expected = {  # i: (lr, first beta), by hand for a 4 + 4 cycle
        0: (0.325, 0.875),
        1: (0.55, 0.85),
        3: (1.0, 0.8),
        5: (0.55, 0.85),
        7: (0.1, 0.9),
        8: (0.1 / 1.25, 0.9 * 1.05),  # decay step 1 of decay_step_size 2
        11: (0.1 / 2.0, 0.9 * 1.2),
    }
    for i, (lr, beta1) in expected.items():
        schedule.step(i)
        assert group["lr"] == pytest.approx(lr, rel=1e-12)
        assert group["betas"][0] == pytest.approx(beta1, rel=1e-12)
        assert group["betas"][1] == 0.999  # the second beta is left alone


def test_one_cycle_staircase_hand_values() -> None:
    opt = sgd()
    schedule = OneCycle(
        opt, 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2, cycle_momentum=False
    )
    assert [lr_at(schedule, opt, i)[0] for i in range(9)] == [
        0.0,
        0.5,
        0.5,
        1.0,
        0.5,
        0.5,
        0.0,
        0.0,
        0.0,
    ]


def test_one_cycle_matches_closed_form_asymmetric() -> None:
    first, second, lo, hi = 6, 10, 0.01, 0.5
    total = first + second

    def closed_form(i: int) -> float:
        if i >= total:
            return lo  # decay disabled (decay_step_size 0)
        position = (i + 1) % total
        if position <= first:
            return lo + (hi - lo) * position / first
        return lo + (hi - lo) * (total - position) / second

    opt = sgd()
    schedule = OneCycle(
        opt,
        lo,
        hi,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        cycle_momentum=False,
    )
    for i in range(total + 5):
        assert lr_at(schedule, opt, i) == [pytest.approx(closed_form(i), rel=1e-12)]


def test_one_cycle_cycles_sgd_momentum() -> None:
    opt = sgd(momentum=0.9)
    schedule = OneCycle(
        opt, 0.1, 1.0, cycle_first_step_size=2, cycle_min_mom=0.85, cycle_max_mom=0.95
    )
    assert opt.param_groups[0]["momentum"] == 0.85
    schedule.step(1)  # peak lr <-> lowest momentum
    assert opt.param_groups[0]["lr"] == 1.0 and opt.param_groups[0]["momentum"] == pytest.approx(
        0.85
    )
    schedule.step(3)
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.95)


def test_one_cycle_without_momentum_support_disables_cycling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))])
    with caplog.at_level(logging.WARNING):
        schedule = OneCycle(opt, 0.1, 1.0, cycle_first_step_size=2)
    assert not schedule.cycle_momentum and "cycle_momentum is disabled" in caplog.text
    schedule.step()
    assert "momentum" not in opt.param_groups[0] and schedule.get_mom() is None


# ---------------------------------------------------------------- shared behaviour
SCHEDULES = [
    lambda opt: WarmupLR(opt, warmup_max_lr=0.5, warmup_num_steps=25),
    lambda opt: WarmupDecayLR(
        opt, total_num_steps=80, warmup_max_lr=0.5, warmup_num_steps=25, warmup_type="linear"
    ),
    lambda opt: WarmupCosineLR(opt, total_num_steps=80, warmup_num_steps=25),
    lambda opt: OneCycle(
        opt,
        0.01,
        0.5,
        cycle_first_step_size=20,
        cycle_second_step_size=30,
        decay_lr_rate=0.2,
        decay_step_size=5,
    ),
    lambda opt: LRRangeTest(opt, 0.01, 10, 0.3, True),
]


@pytest.mark.parametrize("make", SCHEDULES)
def test_state_dict_round_trip_mid_schedule(make) -> None:
    opt_a, opt_b = sgd(lr=0.5, momentum=0.9), sgd(lr=0.5, momentum=0.9)
    original = make(opt_a)
    for _ in range(37):
        original.step()
    resumed = make(opt_b)
    resumed.load_state_dict(original.state_dict())
    assert resumed.state_dict() == {"last_batch_iteration": 36}
    for _ in range(60):
        original.step()
        resumed.step()
        assert resumed.get_last_lr() == original.get_last_lr()
        assert opt_b.param_groups[0]["momentum"] == opt_a.param_groups[0]["momentum"]


def test_step_accepts_deepspeed_argument_names() -> None:
    opt = sgd()
    schedule = LRRangeTest(opt, 0.1, 10, 1.0)
    schedule.step(batch_iteration=9)
    assert schedule.last_batch_iteration == 9 and opt.param_groups[0]["lr"] == pytest.approx(0.2)
    schedule.step(last_batch_iteration=19)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.3)
    with pytest.raises(TypeError):
        schedule.step(1, batch_iteration=2)


def test_get_last_lr_before_any_lr_is_set() -> None:
    schedule = WarmupLR(sgd(), last_batch_iteration=5)
    with pytest.raises(RuntimeError, match="step"):
        schedule.get_last_lr()


# ---------------------------------------------------------------- build / resolve
def test_build_scheduler_names_case_insensitive_and_torch_fallback() -> None:
    opt = sgd(lr=0.1)
    assert type(build_scheduler(block("warmuplr", warmup_num_steps=5), opt)) is WarmupLR
    assert type(build_scheduler(block("WarmupDecayLR", total_num_steps=1000), opt)) is WarmupDecayLR
    assert (
        type(build_scheduler(block("WARMUPCOSINELR", total_num_steps=2000), opt)) is WarmupCosineLR
    )
    assert (
        type(build_scheduler(block("OneCycle", cycle_min_lr=0.1, cycle_max_lr=1.0), opt))
        is OneCycle
    )
    assert type(build_scheduler(block("LRRangeTest"), opt)) is LRRangeTest
    step_lr = build_scheduler(block("StepLR", step_size=3, gamma=0.5), opt)
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR) and step_lr.gamma == 0.5
    assert isinstance(
        build_scheduler(block("cosineannealinglr", T_max=10), opt),
        torch.optim.lr_scheduler.CosineAnnealingLR,
    )
    # DeepSpeed configs may carry last_batch_iteration as a param.
    resumed = build_scheduler(block("WarmupLR", last_batch_iteration=-1, warmup_max_lr=0.1), opt)
    assert resumed.last_batch_iteration == -1


def test_build_scheduler_errors_name_the_key() -> None:
    opt = sgd()
    with pytest.raises(ConfigError, match=r"scheduler.type='WarmupLRR'.*Did you mean 'WarmupLR'"):
        build_scheduler(block("WarmupLRR"), opt)
    with pytest.raises(
        ConfigError, match=r"scheduler\.params\.warmup_max_lrr.*scheduler\.params\.warmup_max_lr"
    ):
        build_scheduler(block("WarmupLR", warmup_max_lrr=0.1), opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.total_num_steps.*required"):
        build_scheduler(block("WarmupDecayLR"), opt)
    with pytest.raises(
        ConfigError, match=r"scheduler\.params\.total_num_steps = 5 .*warmup_num_steps \(10\)"
    ):
        build_scheduler(block("WarmupDecayLR", total_num_steps=5, warmup_num_steps=10), opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.total_num_steps"):
        build_scheduler(block("WarmupCosineLR", total_num_steps=5, warmup_num_steps=10), opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_type"):
        build_scheduler(block("WarmupLR", warmup_type="cosine"), opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_num_steps"):
        build_scheduler(block("WarmupLR", warmup_num_steps=-3), opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.lr_range_test_step_size"):
        build_scheduler(block("LRRangeTest", lr_range_test_step_size=0), opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.cycle_max_lr.*required"):
        build_scheduler(block("OneCycle", cycle_min_lr=0.1), opt)
    with pytest.raises(ConfigError, match=r"scheduler\.params\.cycle_first_step_size"):
        build_scheduler(
            block("OneCycle", cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0), opt
        )
    with pytest.raises(ConfigError, match="no optimizer"):
        build_scheduler(block("WarmupLR"), None)


def test_resolve_scheduler() -> None:
    opt = sgd()
    client = WarmupLR(opt)
    assert resolve_scheduler(client, None, opt) is client
    assert resolve_scheduler(None, None, opt) is None
    assert type(resolve_scheduler(None, block("LRRangeTest"), opt)) is LRRangeTest
    made = resolve_scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, 2), None, opt)
    assert isinstance(made, torch.optim.lr_scheduler.StepLR) and made.optimizer is opt
    with pytest.raises(ConfigError, match="remove one"):
        resolve_scheduler(client, block("WarmupLR"), opt)
    with pytest.raises(TypeError, match="step"):
        resolve_scheduler(object(), None, opt)
