"""GradientPath: the one interface the engine drives, and MultiGroupPath (several reduce groups).

[Note: the gradient path]
A training loop asks four things of the code between ``loss.backward()`` and the next forward:
bracket the backward (:meth:`GradientPath.prepare_backward` / :meth:`finish_backward`: the
reductions), take the update (:meth:`step`: non-finite vote, norm, clip, optimizer step,
publish the new weights), drop the gradients (:meth:`zero_grad`) and save/restore what it
owns (:meth:`state_dict` / :meth:`load_state_dict`); :meth:`memory_report` says what it
holds. Each ZeRO stage is one implementation:

- stage 0 (:class:`~slipstream.zero.ReplicatedGradientPath`): replicated parameters and
  optimizer, gradients all-reduced in buckets during backward (DDP's schedule);
- stages 1-2 (``ShardedOptimizerStates``): replicated parameters, sharded masters and
  optimizer states (and gradients at stage 2), offload included;
- stage 3 (``Stage3GradientPath``): sharded parameters;
- :class:`MultiGroupPath`: several of the above over different groups of ranks sharing one
  optimizer (dense parameters over the data-parallel group, each expert group's over its
  expert-data-parallel group), stepped together.

The engine picks one, once (``engine.gradient_path``); every step path shares
:func:`slipstream.zero.optimizer.take_sharded_step`, so no two copies of the update exist.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol, runtime_checkable

import torch

from slipstream.zero.group import DataParallelGroup
from slipstream.zero.masters import ShardedMasterWeights
from slipstream.zero.optimizer import StepOutcome, take_sharded_step

__all__ = ["GradientPath", "GradientPathMixin", "MultiGroupPath", "masters_memory"]


@runtime_checkable
class GradientPath(Protocol):
    """What the engine drives: the backward bracket, the step, gradients, state, memory."""

    def prepare_backward(self, is_boundary: bool, loss_scale: float | None = None) -> None:
        """Before ``loss.backward()``: whether it ends an accumulation cycle, the fp16 scale."""
        ...

    def finish_backward(self, is_boundary: bool = True) -> None:
        """After ``loss.backward()``: complete the reductions of this backward."""
        ...

    def step(
        self,
        loss_scale: float | None = None,
        max_grad_norm: float = 0.0,
        grad_norm: torch.Tensor | None = None,
        nonfinite_check: torch.Tensor | None = None,
        defer_skip: bool = False,
        grad_squares: torch.Tensor | None = None,
    ) -> StepOutcome:
        """One update (skipped on every rank when any rank saw an inf or nan); with
        ``defer_skip`` the skip may be decided on the device (``StepOutcome.skipped``);
        ``grad_squares``: the caller's all-reduced sum of squares, which then carries the
        vote and the norm (:func:`~slipstream.zero.take_sharded_step`)."""
        ...

    def zero_grad(self) -> None:
        """Drop every gradient this path holds."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's masters and optimizer state (positional: the path's parameter order)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (same layout) and publish the weights; an
        empty ``"optimizer"`` keeps the optimizer's state (a weights-only load)."""
        ...

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by kind (masters, gradients, optimizer states, buckets;
        ``publish_buffer_<device>``: memory outside the caching allocator's statistics)."""
        ...

    def resident(self) -> Any:
        """A context in which masters and optimizer states are in host/device memory."""
        ...

    def close(self) -> None:
        """Release workers and swap files (offload); the path cannot step afterwards."""
        ...


def masters_memory(
    masters: ShardedMasterWeights, optimizer: torch.optim.Optimizer
) -> dict[str, int]:
    """Bytes of ``masters``, their gradients and their optimizer state, by device kind."""
    report: dict[str, int] = {}

    def add(key: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        name = f"{key}_{tensor.device.type}"
        report[name] = report.get(name, 0) + tensor.numel() * tensor.element_size()

    for master in masters.masters:
        add("masters", master)
        add("master_grads", master.grad)
        for value in optimizer.state.get(master, {}).values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                add("optimizer_states", value)
    return report


def _masters_state(masters: ShardedMasterWeights) -> list[torch.Tensor]:
    return [m.detach() for m in masters.masters]


def _load_masters(masters: ShardedMasterWeights, values: Sequence[torch.Tensor]) -> None:
    if len(values) != len(masters.masters):
        raise ValueError(
            f"the gradient-path state holds {len(values)} master shards, this path has "
            f"{len(masters.masters)}: it was saved from a different model or layout"
        )
    with torch.no_grad():
        for master, value in zip(masters.masters, values):
            if master.shape != value.shape:
                raise ValueError(
                    f"a saved master shard has shape {tuple(value.shape)}, this path's "
                    f"{tuple(master.shape)}: saved at another world size or model"
                )
            master.copy_(value)


class GradientPathMixin:
    """The single-group half of :class:`GradientPath` (stages 1-2 and 3 share it): ``step``
    through the stage's :class:`~slipstream.zero.ZeroOptimizer`, state and memory."""

    optimizer: Any  # ZeroOptimizer
    masters: ShardedMasterWeights
    reducer: Any

    def step(
        self,
        loss_scale: float | None = None,
        max_grad_norm: float = 0.0,
        grad_norm: torch.Tensor | None = None,
        nonfinite_check: torch.Tensor | None = None,
        defer_skip: bool = False,
        grad_squares: torch.Tensor | None = None,
    ) -> StepOutcome:
        """One update: see :meth:`slipstream.zero.ZeroOptimizer.step`."""
        return self.optimizer.step(  # type: ignore[no-any-return]
            loss_scale=loss_scale,
            max_grad_norm=max_grad_norm,
            grad_norm=grad_norm,
            nonfinite_check=nonfinite_check,
            defer_skip=defer_skip,
            grad_squares=grad_squares,
        )

    def publish(self) -> None:
        """Make the model see the masters' values (stages override)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """``{"masters": [shard, ...], "optimizer": torch optimizer state_dict}``."""
        with self.resident():
            return {
                "masters": _masters_state(self.masters),
                "optimizer": self.optimizer.optimizer.state_dict(),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore masters and optimizer state, then publish them to the model.

        ``state["optimizer"]`` may be empty (or absent): the optimizer keeps its state (a
        checkpoint loaded without its optimizer states).
        """
        with self.resident():  # NVMe: the masters are read while publishing too
            _load_masters(self.masters, state["masters"])
            if state.get("optimizer"):
                self.optimizer.optimizer.load_state_dict(state["optimizer"])
            self.publish()

    def memory_report(self) -> dict[str, int]:
        """Masters, master gradients, optimizer states by device, and live bucket bytes."""
        report = masters_memory(self.masters, self.optimizer.optimizer)
        report["reduce_buckets_live"] = int(self.reducer.live_bytes())
        return report

    def resident(self) -> Any:
        """NVMe offload: masters and states in host memory for the block (else a no-op)."""
        return self.optimizer.resident()

    def close(self) -> None:
        """Stop the offload worker and remove swap files (a no-op without offload)."""
        offload = self.optimizer.offload
        if offload is not None:
            offload.close()


class MultiGroupPath:
    """Several gradient paths over different groups of ranks, sharing one torch optimizer.

    Each part reduces over its own group (``parts[0]``: the dense parameters over the
    data-parallel group; the others, e.g. an expert group's parameters over its
    expert-data-parallel group, whose reduction divides by the data-parallel size: see the
    parts' ``gradient_divisor``). Their shards together hold every gradient element once over
    ``norm_group`` (the world), so the step takes one norm over it: one vote, one clip, one
    ``optimizer.step()``, and every part publishes. Works for stages 1-2
    (``ShardedOptimizerStates`` parts) and stage 3 (``Stage3GradientPath`` parts).

    Offload is not supported (the parts' offloaded steps would each step the shared
    optimizer): the parts refuse it when built with ``strict_optimizer=False``.
    """

    def __init__(
        self,
        parts: Sequence[Any],
        optimizer: torch.optim.Optimizer,
        norm_group: DataParallelGroup,
        device: torch.device,
    ) -> None:
        self.parts = list(parts)
        self.torch_optimizer = optimizer
        self.group = norm_group
        self.device = device
        masters = {id(m) for part in self.parts for m in part.masters.masters}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in masters:
                    raise ValueError(
                        "the optimizer holds a parameter that is not a trainable parameter of "
                        "the model; build the optimizer from model.parameters() (or param "
                        "groups of them)"
                    )

    # The engine reads ``path.optimizer`` as what the LR scheduler and the user step.
    @property
    def optimizer(self) -> MultiGroupPath:
        """This path (it duck-types the optimizer: ``param_groups``, ``state``, ``step``)."""
        return self

    @property
    def offload(self) -> None:
        """No optimizer offload on a multi-group path."""
        return None

    @property
    def param_groups(self) -> list[dict]:
        """The shared torch optimizer's parameter groups."""
        return self.torch_optimizer.param_groups

    @property
    def state(self) -> dict:
        """The shared torch optimizer's per-shard state."""
        return self.torch_optimizer.state  # type: ignore[return-value]

    def prepare_backward(self, is_boundary: bool, loss_scale: float | None = None) -> None:
        """Forward the boundary and the loss scale to every part."""
        for part in self.parts:
            part.prepare_backward(is_boundary, loss_scale)

    def finish_backward(self, is_boundary: bool = True) -> None:
        """Complete every part's reduction (the same order on every rank)."""
        for part in self.parts:
            part.finish_backward(is_boundary)

    def step(
        self,
        loss_scale: float | None = None,
        max_grad_norm: float = 0.0,
        grad_norm: torch.Tensor | None = None,
        nonfinite_check: torch.Tensor | None = None,
        defer_skip: bool = False,
        grad_squares: torch.Tensor | None = None,
    ) -> StepOutcome:
        """One update of every part (:func:`~slipstream.zero.optimizer.take_sharded_step`)."""
        grads = [g for part in self.parts for g in part.masters.grads()]
        outcome = take_sharded_step(
            self.torch_optimizer,
            grads,
            self.group,
            self.device,
            loss_scale=loss_scale,
            max_grad_norm=max_grad_norm,
            grad_norm=grad_norm,
            nonfinite_check=nonfinite_check,
            defer_skip=defer_skip,
            grad_squares=grad_squares,
        )
        if not outcome.overflow:
            for part in self.parts:
                part.publish()
        return outcome

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every part's gradients."""
        for part in self.parts:
            part.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """``{"parts": [{"masters": [...]}, ...], "optimizer": shared state_dict}``."""
        return {
            "parts": [{"masters": _masters_state(part.masters)} for part in self.parts],
            "optimizer": self.torch_optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output and publish every part."""
        if len(state["parts"]) != len(self.parts):
            raise ValueError(
                f"the saved state has {len(state['parts'])} parts, this path "
                f"{len(self.parts)}: saved with another expert-parallel layout"
            )
        for part, saved in zip(self.parts, state["parts"]):
            _load_masters(part.masters, saved["masters"])
        if state.get("optimizer"):
            self.torch_optimizer.load_state_dict(state["optimizer"])
        for part in self.parts:
            part.publish()

    def memory_report(self) -> dict[str, int]:
        """The parts' reports, summed (each counts its own masters' optimizer state)."""
        total: dict[str, int] = {}
        for part in self.parts:
            for key, value in part.memory_report().items():
                total[key] = total.get(key, 0) + value
        return total

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Every part's masters resident (a no-op: no offload here)."""
        with ExitStack() as stack:
            for part in self.parts:
                stack.enter_context(part.optimizer.resident())
            yield

    def close(self) -> None:
        """Nothing to release (no offload)."""

    def complete_step(self) -> None:
        """Nothing runs behind ``step()`` here."""
