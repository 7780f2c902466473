"""ReplicatedGradientPath: ZeRO stage 0 (DDP's layout) behind the GradientPath interface.

Every rank keeps the whole model, the whole optimizer state and (under fp16/bf16) fp32
master copies of the parameters. Gradients are all-reduced in buckets while backward still
runs (:class:`~slipstream.zero.allreduce.GradientReducer`), then every rank takes the same
update. Expert-parallel parameters (an MoE layer's experts, ``ep_size > 1``) are summed over
their expert-data-parallel group instead, after backward, and divided by the data-parallel
size (every rank's loss counts once: see [Note: expert gradients at stage 0]).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.kernels.loss_scaler import inf_or_nan_flag
from slipstream.zero.allreduce import GradientReducer, ReduceSettings, register_ready_hooks
from slipstream.zero.gradient_path import _load_masters, _masters_state, masters_memory
from slipstream.zero.group import DataParallelGroup
from slipstream.zero.optimizer import (
    StepOutcome,
    clip_and_step,
    supports_device_skip,
    take_sharded_step,
    unscale_grads_,
)

__all__ = ["ExpertGroup", "MasterWeights", "ReplicatedGradientPath"]


class MasterWeights:
    """fp32 copies of low-precision model parameters that the optimizer updates.

    Each micro-step's low-precision gradient is added into the master's fp32 ``.grad`` as soon
    as autograd produces it, and the low-precision ``.grad`` is dropped: accumulation over
    gradient-accumulation steps happens in fp32 (summing many bf16 gradients in bf16 loses
    bits) and no low-precision gradient outlives its backward pass.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.masters = [
            torch.nn.Parameter(
                p.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad
            )
            for p in self.params
        ]

    def accumulate(self, index: int) -> None:
        """Move ``params[index].grad`` into the fp32 master gradient."""
        param, master = self.params[index], self.masters[index]
        grad = param.grad
        if grad is None:
            return
        if master.grad is None:
            master.grad = grad.to(torch.float32)
        else:
            master.grad.add_(grad)
        param.grad = None

    def copy_to_model(self) -> None:
        """Write the updated fp32 masters back into the low-precision parameters (one
        multi-tensor copy: a per-parameter loop is host work every step pays)."""
        with torch.no_grad():
            if self.params:
                params: list[torch.Tensor] = list(self.params)
                masters: list[torch.Tensor] = list(self.masters)
                torch._foreach_copy_(params, masters)

    def copy_from_model(self) -> None:
        """Refresh the masters from the model (after loading low-precision weights)."""
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                master.copy_(param)

    def swap_into(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` update the masters instead of the model parameters it was given."""
        by_id = {id(p): m for p, m in zip(self.params, self.masters)}
        for group in optimizer.param_groups:
            for i, p in enumerate(group["params"]):
                if id(p) not in by_id:
                    if not p.requires_grad:
                        continue  # frozen: never has a gradient, so the optimizer skips it
                    raise ValueError(
                        "the optimizer holds a parameter that is not a trainable parameter of the "
                        "model; build the optimizer from model.parameters() (or param groups of them)"
                    )
                master = by_id[id(p)]
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                group["params"][i] = master


@dataclass(frozen=True, slots=True)
class ExpertGroup:
    """The parameters (indices into the path's ``params``) of one expert-parallel group.

    ``data_group``: the expert-data-parallel group their gradients are summed over;
    ``expert_group``: the expert-parallel group whose ranks hold disjoint experts (the norm
    sums their squares over it).
    """

    indices: tuple[int, ...]
    data_group: dist.ProcessGroup | None
    expert_group: dist.ProcessGroup | None


class ReplicatedGradientPath:
    """ZeRO stage 0: replicated parameters and optimizer, gradients all-reduced in buckets.

    ``params``: the trainable parameters, in the order of ``optimizer``'s; ``masters``: keep
    fp32 master copies (fp16/bf16 modules) that ``optimizer`` steps instead, the model
    receiving their values after each step. ``group``: the data-parallel group (None: the
    world; ``group_size=1`` with no group: this rank alone, e.g. a pipeline stage without
    data-parallel replicas, whose grid has no group for them). ``experts``: expert-parallel
    parameter groups, reduced over their own groups.
    ``vote_over_world``: the reduced gradients may differ between ranks of the world (tensor
    parallelism), so the fp16 overflow vote spans it (it always does with ``experts`` and
    for a ``nonfinite_check``).

    >>> path = ReplicatedGradientPath(list(model.parameters()), optimizer, ReduceSettings(
    ...     bucket_numel=25 * 2**20 // 4))
    >>> path.prepare_backward(is_boundary=True); loss.backward(); path.finish_backward()
    >>> path.step(max_grad_norm=1.0); path.zero_grad()
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        settings: ReduceSettings,
        *,
        group: dist.ProcessGroup | None = None,
        group_size: int | None = None,
        masters: bool = False,
        experts: Sequence[ExpertGroup] = (),
        vote_over_world: bool = False,
    ) -> None:
        self.params = list(params)
        self.torch_optimizer = optimizer
        self.settings = settings
        self.group = group
        if group_size is not None:
            self.world_size = group_size
        else:
            self.world_size = comm.get_world_size(group) if comm.is_initialized() else 1
        self.experts = list(experts)
        self.vote_over_world = vote_over_world or bool(self.experts)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.masters = MasterWeights(self.params) if masters else None
        if self.masters is not None and optimizer is not None:
            self.masters.swap_into(optimizer)
        # Where the i-th gradient accumulates: the fp32 master, or the parameter itself.
        self.sources: list[torch.Tensor] = (
            list(self.masters.masters) if self.masters is not None else list(self.params)
        )
        in_experts = {i for expert in self.experts for i in expert.indices}
        self.dense = [i for i in range(len(self.params)) if i not in in_experts]
        # Position of each parameter in the dense reducer (None: an expert parameter).
        self._reducer_index: list[int | None] = [None] * len(self.params)
        for position, index in enumerate(self.dense):
            self._reducer_index[index] = position
        self.reducer: GradientReducer | None = None
        if self.world_size > 1:
            self.reducer = GradientReducer(
                [self.sources[i] for i in self.dense], settings, group=group
            )
        self._reduce_experts = False
        self._hooks = register_ready_hooks(self.params, self._on_grad_ready)

    # The engine reads ``path.optimizer`` as what the LR scheduler and the user step.
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer (stepping the masters, or the parameters in fp32)."""
        return self.torch_optimizer

    @property
    def offload(self) -> None:
        """No optimizer offload at stage 0."""
        return None

    @property
    def num_buckets(self) -> int:
        """Collectives one dense reduction issues."""
        return self.reducer.num_buckets if self.reducer is not None else 0

    def _on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if self.masters is not None:
            self.masters.accumulate(index)
        if self.reducer is not None:
            position = self._reducer_index[index]
            if position is not None:
                self.reducer.mark_ready(position)

    # ------------------------------------------------------------------ backward
    def prepare_backward(self, is_boundary: bool, loss_scale: float | None = None) -> None:
        """Arm the all-reduce when this backward ends an accumulation cycle (else the
        gradients accumulate locally, as under DDP's ``no_sync``)."""
        self._reduce_experts = is_boundary and self.reducer is not None
        if self._reduce_experts:
            assert self.reducer is not None
            self.reducer.start()

    def finish_backward(self, is_boundary: bool = True) -> None:
        """Wait for the dense buckets; reduce the expert gradients over their groups."""
        if self.reducer is not None:
            self.reducer.finish()
        if self._reduce_experts and self.experts:
            for expert in self.experts:
                _reduce_expert_grads(
                    [self.sources[i] for i in expert.indices],
                    expert.data_group,
                    self.world_size,
                    self.settings.bucket_numel,
                )
        self._reduce_experts = False

    # ------------------------------------------------------------------ step
    def grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer reads (masters' or parameters'), those that exist."""
        return [s.grad for s in self.sources if s.grad is not None]

    def step(
        self,
        loss_scale: float | None = None,
        max_grad_norm: float = 0.0,
        grad_norm: torch.Tensor | None = None,
        nonfinite_check: torch.Tensor | None = None,
        defer_skip: bool = False,
        grad_squares: torch.Tensor | None = None,
    ) -> StepOutcome:
        """Vote, unscale, norm, clip, step, copy the masters into the model.

        The vote: an fp16 overflow (``loss_scale``) or, under fp32/bf16, an inf or nan in a
        gradient or in ``nonfinite_check`` (this rank's losses) on any rank. The reduced
        dense gradients are equal everywhere, so without experts, tensor parallelism or a
        ``nonfinite_check`` no collective is needed. ``grad_norm``: the unscaled global norm
        when the caller took it (tensor parallelism), else torch's ``clip_grad_norm_``
        arithmetic here. ``defer_skip``: see :func:`~slipstream.zero.take_sharded_step`.

        ``grad_squares``: the caller's sum of squares of the reduced (scaled) gradients,
        all-reduced over every rank whose gradients differ (a pipeline's stages): it carries
        the vote and gives the norm, and the step is :func:`~slipstream.zero.take_sharded_step`
        with no collective of its own (the gradients are whole: a group of one).
        """
        optimizer = self.torch_optimizer
        if optimizer is None:
            raise RuntimeError(
                "this gradient path has no optimizer to step: pass initialize(optimizer=...) "
                "or add an 'optimizer' block to the config"
            )
        grads = self.grads()
        if grad_squares is not None:
            outcome = take_sharded_step(
                optimizer,
                grads,
                DataParallelGroup(None, 1, 0),
                self.device,
                loss_scale=loss_scale,
                max_grad_norm=max_grad_norm,
                grad_norm=grad_norm,
                nonfinite_check=nonfinite_check,
                defer_skip=defer_skip,
                grad_squares=grad_squares,
            )
            if self.masters is not None and not outcome.overflow:
                self.masters.copy_to_model()
            return outcome
        found_inf: torch.Tensor | None = None
        if (
            (loss_scale is not None or nonfinite_check is not None)
            and grad_norm is None
            and not self.vote_over_world
        ):
            # [Note: the stage-0 vote rides on the norm] The norm's one multi-tensor pass
            # decides the vote too: no per-gradient isfinite/all (five dispatches a tensor,
            # the host's largest share of a small model's step).
            unscale_grads_(grads, loss_scale)
            norm = self._global_norm()
            found_inf = self._vote_on_norm(norm, nonfinite_check)
            if not (defer_skip and supports_device_skip(optimizer)):
                if bool(found_inf.item()):  # host sync: the step must know now whether to skip
                    return StepOutcome(overflow=True, grad_norm=None)
                found_inf = None
            clip_and_step(optimizer, grads, norm, max_grad_norm, found_inf)
            if self.masters is not None:
                self.masters.copy_to_model()  # after a skip: the unchanged values again
            return StepOutcome(overflow=False, grad_norm=norm, skipped=found_inf)
        if loss_scale is not None or nonfinite_check is not None:
            found_inf = self._vote(grads, nonfinite_check)
            if not (defer_skip and supports_device_skip(optimizer)):
                if bool(found_inf.item()):  # host sync: the step must know now whether to skip
                    return StepOutcome(overflow=True, grad_norm=None)
                found_inf = None
        unscale_grads_(grads, loss_scale)
        norm = grad_norm if grad_norm is not None else self._global_norm()
        clip_and_step(optimizer, grads, norm, max_grad_norm, found_inf)
        if self.masters is not None:
            self.masters.copy_to_model()  # after a skip: the unchanged values again
        return StepOutcome(overflow=False, grad_norm=norm, skipped=found_inf)

    def _vote_on_norm(
        self, norm: torch.Tensor | None, nonfinite_check: torch.Tensor | None
    ) -> torch.Tensor:
        """1.0 on every rank when the (unscaled) global norm or any rank's
        ``nonfinite_check`` is inf or nan, as a 0-d float on the device; nothing waits.

        [Note: the stage-0 vote rides on the norm] Without tensor parallelism or experts
        (``vote_over_world``) the reduced gradients, hence the norm, are equal on every rank,
        and an inf or nan in any gradient makes the norm non-finite, so it carries the
        gradients' vote (as the ZeRO stages' summed squares do, [Note: one collective per
        step]). A finite gradient whose squares overflow fp32
        (an element beyond ~1.8e19) counts as non-finite too, as it does there. Only the
        per-rank ``nonfinite_check`` needs a collective: ``check * 0`` is 0 or nan, summed
        over the world.
        """
        bad = (
            norm.detach().float().reshape(())
            if norm is not None
            else torch.zeros((), dtype=torch.float32, device=self.device)
        )
        if nonfinite_check is not None:
            check = nonfinite_check.detach().float().reshape(()).to(bad.device) * 0.0
            if comm.is_initialized() and comm.get_world_size() > 1:
                comm.all_reduce(check)
            bad = bad + check
        return (~torch.isfinite(bad)).to(torch.float32)

    def _vote(
        self, grads: list[torch.Tensor], nonfinite_check: torch.Tensor | None
    ) -> torch.Tensor:
        """1.0 on every rank when any rank's gradients (or ``nonfinite_check``) hold an inf
        or nan, as a 0-d float on the device; nothing here waits for it."""
        checked: list[torch.Tensor] = list(grads)
        if nonfinite_check is not None:
            checked.append(nonfinite_check.detach())
        flag = inf_or_nan_flag(checked)
        if flag is None:
            flag = torch.zeros((), dtype=torch.float32, device=self.device)
        flag = flag.to(self.device)
        if (
            (self.vote_over_world or nonfinite_check is not None)
            and comm.is_initialized()
            and comm.get_world_size() > 1
        ):
            comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def _global_norm(self) -> torch.Tensor | None:
        """The L2 norm of the whole reduced gradient, torch's ``clip_grad_norm_`` arithmetic.

        [Note: expert gradients at stage 0] Dense gradients are equal on every rank after
        the reduction and count once; an expert group's experts are spread over its
        expert-parallel group (disjoint experts) and replicated across expert-data-parallel
        groups, so its squares are summed over the expert-parallel group.
        """
        if not self.experts:
            grads = self.grads()
            if not grads:
                return None
            norms = torch._foreach_norm(grads, 2.0)
            return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)
        total = _squares([self.sources[i].grad for i in self.dense], self.device)
        for expert in self.experts:
            share = _squares([self.sources[i].grad for i in expert.indices], self.device)
            if expert.expert_group is not None:
                comm.all_reduce(share, group=expert.expert_group, log_name="moe_grad_norm")
            total = total + share
        return total.sqrt()

    def zero_grad(self) -> None:
        """Drop every gradient (model and masters); they are always set to None."""
        for param in self.params:
            param.grad = None
        for source in self.sources:
            source.grad = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``{"masters": [fp32 master, or the parameter in fp32, ...], "optimizer": ...}``."""
        optimizer = self.torch_optimizer
        return {
            "masters": _masters_state(_Masters(self.sources)),  # type: ignore[arg-type]
            "optimizer": optimizer.state_dict() if optimizer is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the model receives the masters' values.

        ``state["masters"]`` may be None (or absent): the model's weights were restored
        elsewhere (a checkpoint's model file) and the fp32 masters, if any, are refreshed
        from them. ``state["optimizer"]`` may be empty: the optimizer keeps its state.
        """
        if state.get("masters") is None:
            if self.masters is not None:
                self.masters.copy_from_model()
        else:
            _load_masters(_Masters(self.sources), state["masters"])  # type: ignore[arg-type]
            if self.masters is not None:
                self.masters.copy_to_model()
        if self.torch_optimizer is not None and state.get("optimizer"):
            self.torch_optimizer.load_state_dict(state["optimizer"])

    def memory_report(self) -> dict[str, int]:
        """Masters (or parameters), their gradients, optimizer states, live bucket bytes."""
        report: dict[str, int] = {}
        if self.torch_optimizer is not None:
            holder = _Masters(self.sources)
            report = masters_memory(holder, self.torch_optimizer)  # type: ignore[arg-type]
        report["reduce_buckets_live"] = self.reducer.live_bytes() if self.reducer else 0
        return report

    def resident(self) -> Any:
        """Everything is always resident here (no offload)."""
        return nullcontext()

    def close(self) -> None:
        """Remove the gradient hooks; the path cannot reduce afterwards."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def complete_step(self) -> None:
        """Nothing runs behind ``step()`` here."""


@dataclass(slots=True)
class _Masters:
    """What :func:`masters_memory` reads: ``.masters``."""

    masters: list[torch.Tensor]


def _squares(grads: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.float().pow(2).sum() for g in present]).sum()


def _reduce_expert_grads(
    sources: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    divisor: int,
    bucket_numel: int,
) -> None:
    """All-reduce ``sources[i].grad`` over ``group`` in buckets of at most ``bucket_numel``
    elements per dtype (backward order), then divide by ``divisor``. A missing gradient (an
    expert that got no token) is reduced as zeros, so every rank issues the same
    collectives and ends with a gradient."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for source in reversed(sources):
        by_dtype.setdefault(source.dtype, []).append(source)
    for tensors in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for tensor in tensors:
            if bucket and size + tensor.numel() > bucket_numel:
                _allreduce_bucket(bucket, group, divisor)
                bucket, size = [], 0
            bucket.append(tensor)
            size += tensor.numel()
        if bucket:
            _allreduce_bucket(bucket, group, divisor)


def _allreduce_bucket(
    sources: list[torch.Tensor], group: dist.ProcessGroup | None, divisor: int
) -> None:
    flat = torch.cat(
        [
            s.grad.reshape(-1) if s.grad is not None else torch.zeros_like(s).reshape(-1)
            for s in sources
        ]
    )
    comm.all_reduce(flat, group=group, log_name="expert_grad_allreduce")
    flat.div_(divisor)
    offset = 0
    for source in sources:
        reduced = flat[offset : offset + source.numel()].view_as(source)
        if source.grad is None:
            source.grad = reduced.clone()
        else:
            source.grad.copy_(reduced)
        offset += source.numel()
