"""ZeroOptimizer: one optimizer step over sharded masters (unscale, overflow vote, clip, update)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.norms import clip_grads_, global_grad_norm, overflow_on_any_rank

__all__ = ["StepOutcome", "ZeroOptimizer"]


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one :meth:`ZeroOptimizer.step` did: skipped for an fp16 overflow, and the grad norm."""

    overflow: bool
    grad_norm: torch.Tensor | None


class ZeroOptimizer:
    """Runs a torch optimizer on master shards and publishes the result to the model.

    The gradient path (stage 1/2 reduce-scatter, stage 3 per-module hooks) fills
    ``masters[i].grad`` with the averaged gradient shard; :meth:`step` then

    1. votes on fp16 overflow across ranks (no rank sees every gradient),
    2. unscales by the loss scale, takes the global norm (one scalar all-reduce) and clips,
    3. steps the wrapped optimizer (its states exist for the shards only),
    4. calls ``publish()``: stages 1-2 all-gather the shards into the full parameters,
       stage 3 refreshes the 16-bit parameter shards.

    It duck-types the parts of ``torch.optim.Optimizer`` that schedulers and loops use
    (``param_groups``, ``state``, ``zero_grad``) by forwarding to the wrapped optimizer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        masters: ShardedMasterWeights,
        group: DataParallelGroup,
        publish: Callable[[], None],
        device: torch.device,
    ) -> None:
        self.optimizer = optimizer
        self.masters = masters
        self.group = group
        self._publish = publish
        self.device = device

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (holding the master shards)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The wrapped optimizer's per-shard state."""
        return self.optimizer.state  # type: ignore[return-value]

    def step(
        self,
        loss_scale: float | None = None,
        max_grad_norm: float = 0.0,
        grad_norm: torch.Tensor | None = None,
    ) -> StepOutcome:
        """Take one update from the reduced gradient shards; skip it on an fp16 overflow.

        ``grad_norm``: the global norm of the (unscaled) gradients when the caller has computed
        it, e.g. a pipeline's norm, which also spans the other stages this group does not
        reach. None: computed here from the shards over the data-parallel group.
        """
        grads = self.masters.grads()
        if loss_scale is not None and overflow_on_any_rank(grads, self.group, self.device):
            return StepOutcome(overflow=True, grad_norm=None)
        if loss_scale is not None and loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        norm = (
            grad_norm if grad_norm is not None else global_grad_norm(grads, self.group, self.device)
        )
        clip_grads_(grads, norm, max_grad_norm)
        self.optimizer.step()
        self._publish()
        return StepOutcome(overflow=False, grad_norm=norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the master gradients (always set to None)."""
        self.masters.zero_grad()
