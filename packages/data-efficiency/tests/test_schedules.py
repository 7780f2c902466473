"""Curriculum and random-LTD schedules against DeepSpeed's formulas, written out step by step."""

from __future__ import annotations

import math

import pytest

from slipstream.data import CurriculumScheduler, RandomLTDConfig, RandomLTDScheduler


def _root_formula(step: int, low: int, high: int, total: int, diff_step: int, degree: float) -> int:
    # DeepSpeed's __fixed_root_get_difficulty, written independently.
    value = math.floor((step / total) ** (1.0 / degree) * (high - low) + low)
    value = value - value % diff_step
    return min(value, high)


@pytest.mark.parametrize(
    ("low", "high", "total", "diff_step", "degree"),
    [(8, 1024, 100, 8, 1), (64, 2048, 37, 8, 2), (5, 300, 50, 16, 3), (0, 96, 10, 1, 2)],
)
def test_fixed_root_and_linear_follow_the_formula(
    low: int, high: int, total: int, diff_step: int, degree: float
) -> None:
    kind = "fixed_linear" if degree == 1 else "fixed_root"
    config = {"total_curriculum_step": total, "difficulty_step": diff_step}
    if kind == "fixed_root":
        config["root_degree"] = degree
    scheduler = CurriculumScheduler(
        {"min_difficulty": low, "max_difficulty": high, "schedule_type": kind,
         "schedule_config": config}
    )  # fmt: skip
    assert scheduler.get_current_difficulty() == low
    current = low
    for step in range(1, total + 20):
        if current < high:  # the difficulty freezes once it reaches max
            current = _root_formula(step, low, high, total, diff_step, degree)
        assert scheduler.update_difficulty(step) == current, step
    assert current == high


def test_fixed_discrete_follows_the_lists() -> None:
    scheduler = CurriculumScheduler(
        {"min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
         "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}}
    )  # fmt: skip
    expected = [1] * 5 + [2] * 5 + [3] * 5  # steps 1..15
    assert [scheduler.update_difficulty(s) for s in range(1, 16)] == expected


def test_difficulty_stays_once_max_is_reached() -> None:
    scheduler = CurriculumScheduler(
        {"min_difficulty": 8, "max_difficulty": 16, "schedule_type": "fixed_linear",
         "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}
    )  # fmt: skip
    assert scheduler.update_difficulty(4) == 16
    assert scheduler.update_difficulty(1) == 16  # a smaller step no longer moves it


def test_custom_schedule_and_state_round_trip() -> None:
    scheduler = CurriculumScheduler(
        {"min_difficulty": 0, "max_difficulty": 100, "schedule_type": "custom"}
    )
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: 10 * step)
    assert scheduler.update_difficulty(3) == 30
    other = CurriculumScheduler(
        {"min_difficulty": 0, "max_difficulty": 100, "schedule_type": "custom"}
    )
    other.load_state_dict(scheduler.state_dict())
    assert other.get_current_difficulty() == 30


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"max_difficulty": 4, "schedule_type": "fixed_linear"}, "min_difficulty"),
        ({"min_difficulty": 9, "max_difficulty": 4, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 1, "difficulty_step": 1}}, "above"),
        ({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "fixed_root",
          "schedule_config": {"total_curriculum_step": 1, "difficulty_step": 1}}, "root_degree"),
        ({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "fixed_discrete",
          "schedule_config": {"difficulty": [1, 2], "max_step": [1, 2]}}, "one more"),
        ({"min_difficulty": 1, "max_difficulty": 4, "schedule_type": "cosine"}, "cosine"),
    ],
)  # fmt: skip
def test_bad_schedules_are_named(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CurriculumScheduler(params)


def _ltd_config(low: int, high: int, steps: int, per_step: int) -> RandomLTDConfig:
    return RandomLTDConfig.from_dict(
        {"enabled": True, "total_layer_num": 12, "random_ltd_layer_num": 10,
         "random_ltd_layer_id": list(range(1, 11)), "model_mask_name": "attention_mask",
         "model_type": "decoder", "hidden_state_order": "batch_seq_dim",
         "random_ltd_schedule": {"min_value": low, "max_value": high,
                                 "schedule_type": "fixed_linear",
                                 "schedule_config": {"require_steps": steps,
                                                     "seq_per_step": per_step}}}
    )  # fmt: skip


def test_random_ltd_schedule_and_layer_tokens_follow_the_formula() -> None:
    low, high, steps, per_step, batch = 128, 1024, 40, 8, 4
    scheduler = RandomLTDScheduler(_ltd_config(low, high, steps, per_step), batch)
    current, consumed = low, 0
    for step in range(0, 60):
        for _ in range(2):  # two micro-batches of one step: tokens are counted once
            if current < high:
                value = math.floor(step / steps * (high - low) + low)
                current = min(value - value % per_step, high)
            assert scheduler.update_seq(step) == current
        consumed += batch * (current * 10 + high * 2)
        assert scheduler.state["consumed_layer_tokens"] == consumed
    fresh = RandomLTDScheduler(_ltd_config(low, high, steps, per_step), batch)
    assert fresh.get_total_layer_tokens(60) == consumed
    fresh.load_state_dict(scheduler.state_dict())
    assert fresh.state_dict() == scheduler.state_dict()
