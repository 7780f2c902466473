"""RandomLTDScheduler: how many tokens random-LTD layers keep, and the layer-tokens consumed.

[Note: random-LTD schedule arithmetic]
As in DeepSpeed's ``RandomLTDScheduler`` (fixed_linear only)::

    kept = floor(step / require_steps * (max_value - min_value) + min_value)
    kept -= kept % seq_per_step
    kept = min(kept, max_value)

and it only moves while below ``max_value``. Once per new step, the consumed layer-tokens grow
by ``global_batch * (kept * random_ltd_layer_num + max_value * (total_layer_num -
random_ltd_layer_num))``: the token-based LR schedule decays over that count.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from slipstream.data.config import RandomLTDConfig

__all__ = ["RandomLTDScheduler"]


class RandomLTDScheduler:
    """Kept-token count of random-LTD layers per step, and the layer-tokens consumed so far.

    >>> from slipstream.data.config import RandomLTDConfig
    >>> config = RandomLTDConfig.from_dict({"enabled": True, "total_layer_num": 4,
    ...     "random_ltd_layer_num": 2, "random_ltd_layer_id": [1, 2],
    ...     "random_ltd_schedule": {"min_value": 16, "max_value": 64,
    ...         "schedule_config": {"require_steps": 10, "seq_per_step": 8}}})
    >>> scheduler = RandomLTDScheduler(config, global_batch_size=2)
    >>> [scheduler.update_seq(step) for step in (0, 5, 10)]
    [16, 40, 64]
    """

    def __init__(self, config: RandomLTDConfig, global_batch_size: int) -> None:
        schedule = config.random_ltd_schedule
        if schedule is None:
            raise ValueError("random-LTD needs a random_ltd_schedule block (min/max_value, ...)")
        self.model_layer_num = config.total_layer_num
        self.random_ltd_layer_num = config.random_ltd_layer_num
        self.global_batch_size = global_batch_size
        self.require_steps = schedule.schedule_config.require_steps
        self.seq_per_step = schedule.schedule_config.seq_per_step
        self.state: dict[str, Any] = {
            "min_value": schedule.min_value,
            "max_value": schedule.max_value,
            "current_value": schedule.min_value,
            "consumed_layer_tokens": 0,
            "current_steps": -1,
        }
        # Indices sampled by the first random-LTD layer of a forward, shared by the others.
        self.sample_indices: torch.Tensor | None = None
        self.sample_rows: torch.Tensor | None = None  # the same as flat row indices
        self.part_attention_mask: Any = None

    def get_value(self, global_steps: int) -> int:
        """The schedule's kept-token count at ``global_steps``."""
        low, high = self.state["min_value"], self.state["max_value"]
        kept = math.floor(float(global_steps) / self.require_steps * (high - low) + low)
        kept -= kept % self.seq_per_step
        return int(min(kept, high))

    def get_current_seq(self) -> int:
        """Tokens the random-LTD layers keep now."""
        return int(self.state["current_value"])

    def set_current_seq(self, seq_length: int) -> None:
        """Force the kept-token count."""
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        """How many layers drop tokens."""
        return self.random_ltd_layer_num

    def update_seq(self, global_steps: int) -> int:
        """Advance to ``global_steps`` (the engine calls it on every training forward)."""
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            full_layers = self.model_layer_num - self.random_ltd_layer_num
            self.state["consumed_layer_tokens"] += self.global_batch_size * (
                self.state["current_value"] * self.random_ltd_layer_num
                + self.state["max_value"] * full_layers
            )
            self.state["current_steps"] = global_steps
        return int(self.state["current_value"])

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Layer-tokens a fresh schedule consumes over ``train_iters`` steps (for LR planning)."""
        probe = RandomLTDScheduler.__new__(RandomLTDScheduler)
        probe.__dict__.update(self.__dict__)
        probe.state = {**self.state, "current_value": self.state["min_value"]}
        probe.state.update(consumed_layer_tokens=0, current_steps=-1)
        for step in range(train_iters):
            probe.update_seq(step)
        return int(probe.state["consumed_layer_tokens"])

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state (DeepSpeed's keys)."""
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned."""
        self.state.update(state)
