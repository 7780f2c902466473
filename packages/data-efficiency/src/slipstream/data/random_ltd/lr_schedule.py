"""LayerTokenLR: learning-rate warmup and decay over consumed layer-tokens (for random-LTD)."""

from __future__ import annotations

import math
from typing import Any

import torch

from slipstream.data.config import LayerTokenLRScheduleConfig
from slipstream.data.random_ltd.scheduler import RandomLTDScheduler

__all__ = ["LayerTokenLR", "layer_token_lr"]


def layer_token_lr(base_lr: float, tokens: float, config: LayerTokenLRScheduleConfig) -> float:
    """The learning rate after ``tokens`` layer-tokens (warmup, then cosine/linear decay)."""
    warmup = config.warmup_layer_tokens
    total = config.total_layer_tokens
    assert total is not None  # validated with the config
    if warmup > 0 and tokens < warmup:
        if config.warmup_type == "log":
            return base_lr * math.log(tokens + 1) / math.log(warmup + 1)
        return base_lr * tokens / warmup
    progress = min(max((tokens - warmup) / (total - warmup), 0.0), 1.0)
    if config.decay_style == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        factor = 1.0 - progress
    return config.min_lr + (base_lr - config.min_lr) * factor


class LayerTokenLR:
    """Sets each parameter group's LR from the random-LTD scheduler's consumed layer-tokens.

    Random-LTD layers process fewer tokens early in training; decaying over layer-tokens
    rather than steps keeps the LR matched to the work done. ``step()`` is called by the
    engine after each optimizer step, like any LR scheduler.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: RandomLTDScheduler,
        config: LayerTokenLRScheduleConfig,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.config = config
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.last_tokens = 0
        self._apply(0)

    def _apply(self, tokens: int) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = layer_token_lr(base, tokens, self.config)
        self.last_tokens = tokens

    def step(self, **_: Any) -> None:
        """Set the LRs for the layer-tokens consumed so far."""
        self._apply(int(self.scheduler.state["consumed_layer_tokens"]))

    def get_last_lr(self) -> list[float]:
        """The current LR of each group."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Base LRs and the last layer-token count."""
        return {"base_lrs": list(self.base_lrs), "last_tokens": self.last_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict() returned (and the LRs it implies)."""
        self.base_lrs = list(state["base_lrs"])
        self._apply(int(state["last_tokens"]))
