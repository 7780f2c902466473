"""CurriculumScheduler: difficulty as a function of the step, with DeepSpeed's schedules.

[Note: schedule arithmetic]
The formulas and their rounding follow DeepSpeed's ``CurriculumScheduler`` exactly, because
users tune ``total_curriculum_step``/``difficulty_step`` against DeepSpeed's numbers:

* fixed_root (fixed_linear is root_degree 1)::

      d = floor((step / total_curriculum_step) ** (1 / root_degree) * (max - min) + min)
      d -= d % difficulty_step
      d = min(d, max)

  Note that the rounding is down to a multiple of ``difficulty_step`` counted from 0, not
  from ``min``, so the first difficulties can sit below ``min_difficulty`` when ``min`` is
  not itself a multiple (DeepSpeed does the same).
* fixed_discrete: ``difficulty[i]`` for the first i with ``step <= max_step[i]``, the last
  difficulty after ``max_step[-1]``.
* The difficulty only moves while it is below ``max_difficulty``: once reached it stays.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SCHEDULE_TYPES", "CurriculumScheduler"]

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
# The seeds' guide (and older DeepSpeed tutorials) write the schedule names without "fixed_".
_ALIASES = {"linear": "fixed_linear", "root": "fixed_root", "discrete": "fixed_discrete"}


def _required(config: Mapping[str, Any], key: str, why: str) -> Any:
    if key not in config or config[key] is None:
        raise ValueError(f"curriculum learning: missing '{key}' ({why})")
    return config[key]


class CurriculumScheduler:
    """The current difficulty of a curriculum and how it grows with the training step.

    ``params`` is DeepSpeed's dict: ``min_difficulty``, ``max_difficulty``, ``schedule_type``
    and ``schedule_config`` (see the module's note for the formulas).

    >>> scheduler = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64,
    ...     "schedule_type": "fixed_linear",
    ...     "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}})
    >>> [scheduler.update_difficulty(step) for step in (1, 5, 10, 11)]
    [8, 32, 64, 64]
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        low = _required(params, "min_difficulty", "the first difficulty")
        high = _required(params, "max_difficulty", "the last difficulty")
        kind = _required(params, "schedule_type", f"one of {', '.join(SCHEDULE_TYPES)}")
        kind = _ALIASES.get(kind, kind)
        if kind not in SCHEDULE_TYPES:
            raise ValueError(
                f"curriculum learning: schedule_type = {kind!r} is not valid; expected one of "
                f"{', '.join(SCHEDULE_TYPES)}"
            )
        if low > high:
            raise ValueError(
                f"curriculum learning: min_difficulty = {low} is above max_difficulty = {high}"
            )
        schedule = dict(params.get("schedule_config") or {})
        if kind in ("fixed_linear", "fixed_root"):
            _required(schedule, "total_curriculum_step", f"{kind} grows over that many steps")
            _required(schedule, "difficulty_step", "difficulties are multiples of it")
            if kind == "fixed_root":
                _required(schedule, "root_degree", "fixed_root's degree (2 = square root)")
        elif kind == "fixed_discrete":
            levels = _required(schedule, "difficulty", "the list of difficulties")
            steps = _required(schedule, "max_step", "the last step of each difficulty")
            if not levels or len(levels) != len(steps) + 1:
                raise ValueError(
                    "curriculum learning: fixed_discrete needs one more 'difficulty' than "
                    f"'max_step' (got {len(levels)} and {len(steps)})"
                )
        self.state: dict[str, Any] = {
            "min_difficulty": low,
            "max_difficulty": high,
            "current_difficulty": low,
            "schedule_type": kind,
            "schedule_config": schedule,
        }
        self._custom: Callable[[int], int] | None = None

    @property
    def schedule_type(self) -> str:
        """The schedule's type (aliases resolved)."""
        return str(self.state["schedule_type"])

    def get_current_difficulty(self) -> int:
        """The difficulty of the current step."""
        return int(self.state["current_difficulty"])

    def set_current_difficulty(self, difficulty: int) -> None:
        """Force the current difficulty (it keeps following the schedule afterwards)."""
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The difficulty function of a ``"custom"`` schedule: ``step -> difficulty``."""
        self._custom = schedule_function

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at ``global_steps`` (without touching the state)."""
        kind = self.state["schedule_type"]
        if kind == "fixed_discrete":
            return self._fixed_discrete(global_steps)
        if kind == "fixed_linear":
            return self._fixed_root(global_steps, 1.0)
        if kind == "fixed_root":
            return self._fixed_root(global_steps, None)
        if self._custom is None:
            raise RuntimeError(
                'curriculum learning: schedule_type "custom" needs a difficulty function; call '
                "set_custom_get_difficulty(fn) (engine.set_custom_curriculum_learning_schedule)"
            )
        return int(self._custom(global_steps))

    def update_difficulty(self, global_steps: int) -> int:
        """Move to the schedule's difficulty at ``global_steps`` (until max is reached)."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return int(self.state["current_difficulty"])

    def _fixed_discrete(self, global_steps: int) -> int:
        schedule = self.state["schedule_config"]
        levels, steps = schedule["difficulty"], schedule["max_step"]
        for level, last in zip(levels, steps):
            if global_steps <= last:
                return int(level)
        return int(levels[-1])

    def _fixed_root(self, global_steps: int, root_degree: float | None) -> int:
        schedule = self.state["schedule_config"]
        degree = schedule["root_degree"] if root_degree is None else root_degree
        low, high = self.state["min_difficulty"], self.state["max_difficulty"]
        progress = (float(global_steps) / schedule["total_curriculum_step"]) ** (1.0 / degree)
        difficulty = math.floor(progress * (high - low) + low)
        difficulty -= difficulty % schedule["difficulty_step"]
        return int(min(difficulty, high))

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state (JSON-ready)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what state_dict() returned."""
        self.state = copy.deepcopy(dict(state))
