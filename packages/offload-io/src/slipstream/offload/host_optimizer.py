"""HostOptimizer: a torch optimizer's update, run on the CPU by Slipstream's C++ kernels.

ZeRO-Offload keeps the fp32 master weights and the optimizer states in host memory and runs
the update there. The optimizer object stays the user's ``torch.optim.Optimizer`` (its
``param_groups`` hold the host masters; schedulers and checkpoints see what they always see),
but its ``step`` is replaced by :meth:`HostOptimizer.step`, which

- recognises Adam/AdamW, Adagrad and Slipstream's Lion and runs the matching SIMD/OpenMP C++
  step from ``slipstream.kernels`` on the optimizer's own state tensors (same keys, same
  layout as torch's, so a checkpoint moves freely between offloaded and device runs), with
  the low-precision copy of each updated weight written in the same pass;
- falls back to the optimizer's own ``step`` for anything else (logged once: correct, slower);
- walks the parameters in sub-groups of ``sub_group_numel`` elements, so that each finished
  sub-group can be uploaded (``on_sub_group``) while the next one steps, and so that NVMe
  offload needs only a sub-group's states in memory at a time (``swapper``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from slipstream.offload.settings import OptimizerOffload
from slipstream.offload.threads import choose_threads

__all__ = ["HostOptimizer", "StateSwapper", "kernel_for"]

logger = logging.getLogger(__name__)


class StateSwapper(Protocol):
    """What HostOptimizer needs from an NVMe swapper (see slipstream.offload.nvme)."""

    def swap_in(self, params: Sequence[torch.Tensor]) -> None: ...

    def prefetch(self, params: Sequence[torch.Tensor]) -> None: ...

    def swap_out(self, params: Sequence[torch.Tensor]) -> None: ...

    def finish(self) -> None: ...


def kernel_for(optimizer: torch.optim.Optimizer) -> tuple[str | None, str]:
    """``(kernel, why)``: the C++ step that reproduces ``optimizer``'s update, or None and why not."""
    from slipstream.kernels.optim import Lion

    name = type(optimizer).__name__
    # Every group counts: a flag may be set for one parameter group only.
    settings = [optimizer.defaults, *optimizer.param_groups]
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if any(group.get(flag) for group in settings):
                return None, f"{name}({flag}=True) has no C++ step"
        return "adam", f"{name}: C++ Adam"
    if type(optimizer) is torch.optim.Adagrad:
        if any(g.get("lr_decay", 0) != 0 or g.get("maximize") for g in settings):
            return None, f"{name} with lr_decay or maximize has no C++ step"
        return "adagrad", f"{name}: C++ Adagrad"
    if type(optimizer) is Lion:
        return "lion", f"{name}: C++ Lion"
    return None, f"{name} has no C++ step (Adam, AdamW, Adagrad and Lion do)"


def _chunks(params: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    chunks: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for param in params:
        if current and size + param.numel() > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        chunks.append(current)
    return chunks


class HostOptimizer:
    """Runs ``optimizer``'s update on the CPU over its (host, fp32) parameters.

    Args:
        optimizer: a torch optimizer whose parameters are contiguous fp32 CPU tensors whose
            ``.grad`` (fp32, CPU) is set before :meth:`step`.
        settings: the offload settings (sub-group size, threads).
        copies: ``id(param) -> tensor`` to refresh with each updated value (the model's
            low-precision weights or a pinned staging buffer for them), same numel.
        swapper: NVMe offload: brings each sub-group's masters and states in before its step
            and writes them back after.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        settings: OptimizerOffload,
        *,
        copies: Mapping[int, torch.Tensor] | None = None,
        swapper: StateSwapper | None = None,
        announce: bool = True,
    ) -> None:
        self.optimizer = optimizer
        self.settings = settings
        self.copies = dict(copies or {})
        self.swapper = swapper
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.device.type != "cpu" or param.dtype != torch.float32:
                    raise ValueError(
                        "HostOptimizer steps fp32 CPU tensors; got a parameter of dtype "
                        f"{param.dtype} on {param.device}"
                    )
        self.kernel, why = kernel_for(optimizer)
        if self.kernel is not None:
            try:
                from slipstream.kernels.ops import cpu_optim

                self._ops: Any = cpu_optim
                cpu_optim.supported_isas()  # loads (or builds) the extension now, not mid-step
            except ImportError as exc:
                why = f"the C++ CPU optimizers are unavailable ({exc})"
                self.kernel = None
        self.threads = choose_threads(settings.cores_fraction)
        if self.kernel is not None:
            self._ops.set_num_threads(self.threads.threads)
        self.description = (
            f"{why}; {self.threads.threads} thread(s) ({self.threads.reason})"
            if self.kernel is not None
            else f"{why}: running {type(optimizer).__name__}.step() on the CPU instead (slower)"
        )
        if announce:
            (logger.info if self.kernel else logger.warning)(
                "CPU optimizer step: %s", self.description
            )
        self._group_of = {
            id(p): index
            for index, group in enumerate(optimizer.param_groups)
            for p in group["params"]
        }
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        self.sub_groups = _chunks(ordered, settings.sub_group_numel)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(
        self,
        grad_scale: float = 1.0,
        on_sub_group: Callable[[list[torch.Tensor]], None] | None = None,
        before_sub_group: Callable[[list[torch.Tensor]], None] | None = None,
    ) -> None:
        """Update every parameter that has a gradient, one sub-group at a time.

        ``grad_scale`` multiplies each gradient as the step reads it (loss unscaling and the
        clip coefficient, without a separate pass over the gradients). ``on_sub_group(params)``
        runs after each sub-group's update (its copies refreshed); ``before_sub_group(params)``
        before it (e.g. to make the sub-group's copy targets resident).
        """
        swapper = self.swapper
        for index, chunk in enumerate(self.sub_groups):
            if before_sub_group is not None:
                before_sub_group(chunk)
            if swapper is not None:
                swapper.swap_in(chunk)
                if index + 1 < len(self.sub_groups):
                    swapper.prefetch(self.sub_groups[index + 1])
            self.step_params(chunk, grad_scale)
            if on_sub_group is not None:
                on_sub_group(chunk)
            if swapper is not None:
                swapper.swap_out(chunk)
        if swapper is not None:
            swapper.finish()

    def step_params(self, params: Sequence[torch.Tensor], grad_scale: float = 1.0) -> None:
        """Update ``params`` (a subset of the optimizer's) that have a gradient."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is not None:
                by_group.setdefault(self._group_of[id(param)], []).append(param)
        if self.kernel is None:
            self._fallback(by_group, grad_scale)
            return
        for group_index, members in by_group.items():
            group = self.optimizer.param_groups[group_index]
            if self.kernel == "adam":
                self._adam(group, members, grad_scale)
            elif self.kernel == "adagrad":
                self._adagrad(group, members, grad_scale)
            else:
                self._lion(group, members, grad_scale)

    def _refresh(self, params: Sequence[torch.Tensor]) -> None:
        for param in params:
            copy = self.copies.get(id(param))
            if copy is not None:
                copy.copy_(param.view(copy.shape))

    def _fallback(self, by_group: dict[int, list[torch.Tensor]], scale: float) -> None:
        # The optimizer's own step over just these parameters: every group is narrowed to
        # its members in the sub-group (the others to none) for one call, then restored.
        members = [p for group in by_group.values() for p in group]
        if scale != 1.0 and members:
            torch._foreach_mul_(self._grads(members), scale)
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        for index, group in enumerate(groups):
            group["params"] = by_group.get(index, [])
        try:
            self.optimizer.step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params
        self._refresh(members)

    def _split_by_copy(
        self, members: list[torch.Tensor]
    ) -> list[tuple[list[torch.Tensor], list[torch.Tensor] | None]]:
        with_copy = [p for p in members if id(p) in self.copies]
        without = [p for p in members if id(p) not in self.copies]
        parts: list[tuple[list[torch.Tensor], list[torch.Tensor] | None]] = []
        if with_copy:
            parts.append((with_copy, [self.copies[id(p)].view(-1) for p in with_copy]))
        if without:
            parts.append((without, None))
        return parts

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        grads = []
        for param in params:
            grad = param.grad
            assert grad is not None
            grads.append(grad if grad.is_contiguous() else grad.contiguous())
        return grads

    def _adam(self, group: dict[str, Any], members: list[torch.Tensor], scale: float) -> None:
        state = self.optimizer.state
        by_step: dict[float, list[torch.Tensor]] = {}
        for param in members:
            entry = state[param]
            if not entry:
                entry["step"] = torch.tensor(0.0, dtype=torch.float32)
                entry["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                entry["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            entry["step"] += 1
            by_step.setdefault(float(entry["step"]), []).append(param)
        beta1, beta2 = group["betas"]
        decoupled = type(self.optimizer) is torch.optim.AdamW or bool(
            group.get("decoupled_weight_decay", False)
        )
        for step, same_step in by_step.items():
            for params, copies in self._split_by_copy(same_step):
                self._ops.adam(
                    params,
                    self._grads(params),
                    [state[p]["exp_avg"] for p in params],
                    [state[p]["exp_avg_sq"] for p in params],
                    lr=float(group["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]),
                    adam_w_mode=decoupled,
                    bias_correction=True,
                    step=int(step),
                    param_copies=copies,
                    grad_scale=scale,
                )

    def _adagrad(self, group: dict[str, Any], members: list[torch.Tensor], scale: float) -> None:
        state = self.optimizer.state
        for param in members:
            entry = state[param]
            if not entry:
                entry["step"] = torch.tensor(0.0, dtype=torch.float32)
                entry["sum"] = torch.full_like(
                    param,
                    float(group["initial_accumulator_value"]),
                    memory_format=torch.preserve_format,
                )
            entry["step"] += 1
        for params, copies in self._split_by_copy(members):
            self._ops.adagrad(
                params,
                self._grads(params),
                [state[p]["sum"] for p in params],
                lr=float(group["lr"]),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                param_copies=copies,
                grad_scale=scale,
            )

    def _lion(self, group: dict[str, Any], members: list[torch.Tensor], scale: float) -> None:
        state = self.optimizer.state
        for param in members:
            entry = state[param]
            if not entry:
                entry["step"] = 0
                entry["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            entry["step"] += 1
        beta1, beta2 = group["betas"]
        for params, copies in self._split_by_copy(members):
            self._ops.lion(
                params,
                self._grads(params),
                [state[p]["exp_avg"] for p in params],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(group["weight_decay"]),
                param_copies=copies,
                grad_scale=scale,
            )
