"""Gradients of expert-parallel MoE parameters in the engine (slipstream.moe, ``ep_size > 1``).

[Note: divisors and the norm]
Every rank trains on its own micro-batches and the loss is the mean over all ``W`` data-parallel
ranks. A dense parameter is replicated everywhere: its gradient is all-reduced (or
reduce-scattered) over the data-parallel group and divided by ``W``. An expert lives only on the
ranks of its expert-data-parallel group; the all-to-all's backward has already brought it the
contributions of every token its expert-parallel group routed to it, so its gradient is summed
over the expert-DP group and divided by ``W`` as well (the number of per-rank losses averaged),
not by the expert-DP size. This is DeepSpeed's rule and what ``slipstream.moe.allreduce_gradients``
does in a hand-written loop.

The global norm counts each gradient element once: dense gradients are equal on every rank after
the reduction (stage 0) or spread over the DP group as shards (stages 1-2); an expert layer's
experts are spread over its expert-parallel group (disjoint experts), replicated across
expert-DP groups (stage 0) or sharded within one (stages 1-2), so its squares are summed over the
expert-DP group when sharded and then over the expert-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm
from slipstream.kernels.loss_scaler import inf_or_nan_flag
from slipstream.zero import DataParallelGroup, ShardedOptimizerStates, ZeroSettings
from slipstream.zero.norms import clip_grads_
from slipstream.zero.optimizer import StepOutcome

__all__ = [
    "ExpertLayout",
    "ExpertParallelZero",
    "agree_overflow",
    "expert_layout",
    "moe_clip_grad_norm",
    "reduce_expert_grads",
]


@dataclass(slots=True)
class ExpertLayout:
    """Which trainable parameters (by index) are dense and which belong to each expert group.

    ``expert[name]`` lists the indices of the parameters whose ``group_name`` is ``name``
    (``"ep_size_<E>"``); ``dp_groups`` / ``ep_groups`` are that name's expert-data-parallel and
    expert-parallel process groups.
    """

    dense: list[int] = field(default_factory=list)
    expert: dict[str, list[int]] = field(default_factory=dict)
    dp_groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    ep_groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    group_of: dict[int, str] = field(default_factory=dict)  # id(param) -> expert group name

    @property
    def is_expert_parallel(self) -> bool:
        """Whether any parameter reduces over a group other than the data-parallel group."""
        return bool(self.expert)


def expert_layout(
    named: Sequence[tuple[str, torch.nn.Parameter]],
    dp_group: dist.ProcessGroup | None,
    dp_world_size: int,
) -> ExpertLayout:
    """Split ``named`` into dense and expert-parallel parameters.

    An expert parameter (``allreduce = False``, with a ``group_name``) whose expert-DP group
    spans the whole data-parallel group (``ep_size == 1``) reduces like a dense one and is left
    dense. Expert parallelism with a data-parallel group narrower than the world (an ``mpu``)
    is refused: slipstream.moe builds its groups over the whole world.
    """
    layout = ExpertLayout()
    for index, (name, param) in enumerate(named):
        group_name = getattr(param, "group_name", None)
        if getattr(param, "allreduce", True) or group_name is None or dp_world_size == 1:
            layout.dense.append(index)
            continue
        from slipstream.moe import get_expert_data_parallel_group, get_expert_parallel_group

        expert_dp = get_expert_data_parallel_group(group_name)
        if comm.get_world_size(expert_dp) == dp_world_size:
            layout.dense.append(index)
            continue
        if dp_group is not None and comm.get_world_size(dp_group) != comm.get_world_size():
            raise NotImplementedError(
                f"parameter {name!r} belongs to an expert-parallel MoE layer ({group_name}), "
                "whose groups slipstream.moe builds over the whole world, but the engine was "
                "given a narrower data-parallel group (mpu). Train expert parallelism without "
                "an mpu, or use ep_size=1."
            )
        layout.expert.setdefault(group_name, []).append(index)
        layout.group_of[id(param)] = group_name
        layout.dp_groups[group_name] = expert_dp
        layout.ep_groups[group_name] = get_expert_parallel_group(group_name)
    return layout


def reduce_expert_grads(
    sources: Sequence[torch.Tensor],
    layout: ExpertLayout,
    divisor: int,
    bucket_numel: int,
) -> None:
    """Stage 0: all-reduce the expert gradients ``sources[i].grad`` over their expert-DP groups,
    in buckets of at most ``bucket_numel`` elements per (group, dtype), then divide by
    ``divisor`` (the data-parallel world size: see the note at the top). A missing gradient (an
    expert that got no token on any micro-step) is reduced as zeros so every rank issues the
    same collectives and ends with a gradient."""
    for name, indices in layout.expert.items():
        group = layout.dp_groups[name]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for i in reversed(indices):  # backward order, as the dense buckets
            by_dtype.setdefault(sources[i].dtype, []).append(sources[i])
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


def agree_overflow(grads: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether any rank's gradients hold an inf or nan (max-reduced over the world: expert
    gradients differ between expert-parallel ranks, so no rank sees them all)."""
    flag = inf_or_nan_flag(list(grads))
    if flag is None:
        flag = torch.zeros((), dtype=torch.float32, device=device)
    if comm.is_initialized() and comm.get_world_size() > 1:
        comm.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())  # host sync: the step must know now whether to skip


def _squares(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.float().pow(2).sum() for g in grads]).sum()


def moe_clip_grad_norm(
    dense: Sequence[torch.Tensor],
    expert: dict[str, list[torch.Tensor]],
    layout: ExpertLayout,
    max_norm: float,
    device: torch.device,
) -> torch.Tensor:
    """Stage 0: the L2 norm of the whole model's reduced gradient, experts of every rank
    included, and clipping to ``max_norm`` (> 0) with torch's coefficient. Dense gradients are
    equal on every rank and count once; each expert group's squares are summed over its
    expert-parallel group (its ranks hold disjoint experts)."""
    total = _squares(dense, device)
    for name, grads in expert.items():
        share = _squares(grads, device)
        group = layout.ep_groups[name]
        if group is not None:
            comm.all_reduce(share, group=group, log_name="moe_grad_norm")
        total = total + share
    norm = total.sqrt()
    all_grads = [*dense, *(g for grads in expert.values() for g in grads)]
    clip_grads_(all_grads, norm, max_norm)
    return norm


class ExpertParallelZero:
    """ZeRO stage 1 or 2 for a model with expert-parallel MoE layers.

    Dense parameters are sharded over the data-parallel group (one ShardedOptimizerStates, as
    without experts); each expert group's parameters over its expert-data-parallel group (one
    more ShardedOptimizerStates each, whose reduce-scatter divides by the data-parallel world
    size: see the note at the top). All parts share the one torch optimizer: the step votes on
    overflow once over the world, takes one global norm, clips every part, steps the optimizer
    once and publishes every part. It is the engine's ``zero`` (backward bracket and
    ``zero_grad``) and ``zero.optimizer`` (``step``) at once.
    """

    def __init__(
        self,
        settings: ZeroSettings,
        dp_group: DataParallelGroup,
        params: Sequence[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        layout: ExpertLayout,
    ) -> None:
        self.optimizer = self
        self.torch_optimizer = optimizer
        self.layout = layout
        self.group = dp_group
        self.device = params[0].device if params else torch.device("cpu")
        self.dense = ShardedOptimizerStates(
            [params[i] for i in layout.dense], optimizer, settings, dp_group, strict_optimizer=False
        )
        self.experts: dict[str, ShardedOptimizerStates] = {}
        for name, indices in layout.expert.items():
            self.experts[name] = ShardedOptimizerStates(
                [params[i] for i in indices],
                optimizer,
                settings,
                DataParallelGroup.of(layout.dp_groups[name]),
                gradient_divisor=dp_group.world_size,
                strict_optimizer=False,
            )
        masters = {id(m) for part in self.parts for m in part.masters.masters}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in masters:
                    raise ValueError(
                        "the optimizer holds a parameter that is not a trainable parameter of "
                        "the model; build the optimizer from model.parameters() (or param "
                        "groups of them)"
                    )

    @property
    def parts(self) -> list[ShardedOptimizerStates]:
        """The dense part, then one part per expert group."""
        return [self.dense, *self.experts.values()]

    # ------------------------------------------------------------------ the gradient path
    def prepare_backward(self, is_boundary: bool, loss_scale: float | None = None) -> None:
        """Forward the boundary (stage 1 reduces only then) and fp16 loss scale to every part."""
        for part in self.parts:
            part.prepare_backward(is_boundary, loss_scale)

    def finish_backward(self, is_boundary: bool = True) -> None:
        """Complete every part's reduce-scatter (the same order on every rank)."""
        for part in self.parts:
            part.finish_backward(is_boundary)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every part's master and full-size gradients."""
        for part in self.parts:
            part.zero_grad()

    # ------------------------------------------------------------------ the optimizer view
    @property
    def param_groups(self) -> list[dict]:
        """The shared torch optimizer's parameter groups."""
        return self.torch_optimizer.param_groups

    @property
    def state(self) -> dict:
        """The shared torch optimizer's per-shard state."""
        return self.torch_optimizer.state  # type: ignore[return-value]

    def step(
        self,
        loss_scale: float | None = None,
        max_grad_norm: float = 0.0,
        grad_norm: torch.Tensor | None = None,
        nonfinite_check: torch.Tensor | None = None,
    ) -> StepOutcome:
        """One update of every part: overflow vote, unscale, global norm, clip, step, publish.

        ``nonfinite_check``: as in :meth:`slipstream.zero.ZeroOptimizer.step` (fp32/bf16).
        """
        dense = self.dense.masters.grads()
        expert = {name: part.masters.grads() for name, part in self.experts.items()}
        grads = [*dense, *(g for gs in expert.values() for g in gs)]
        if loss_scale is not None and agree_overflow(grads, self.device):
            return StepOutcome(overflow=True, grad_norm=None)
        if (
            loss_scale is None
            and nonfinite_check is not None
            and agree_overflow([*grads, nonfinite_check.detach()], self.device)
        ):
            return StepOutcome(overflow=True, grad_norm=None)
        if loss_scale is not None and loss_scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        if grad_norm is None:
            # Dense shards are disjoint over the DP group; an expert group's shards over its
            # expert-DP group, and its experts over its expert-parallel group.
            squares = self.group.sum_(_squares(dense, self.device))
            for name, part in self.experts.items():
                share = part.group.sum_(_squares(expert[name], self.device))
                ep_group = self.layout.ep_groups[name]
                if ep_group is not None:
                    comm.all_reduce(share, group=ep_group, log_name="moe_grad_norm")
                squares = squares + share
            grad_norm = squares.sqrt()
        if max_grad_norm > 0 and not math.isinf(max_grad_norm):
            clip_grads_(grads, grad_norm, max_grad_norm)
        self.torch_optimizer.step()
        for part in self.parts:
            part.publish()
        return StepOutcome(overflow=False, grad_norm=grad_norm)

    # ------------------------------------------------------------------ not supported
    def _no_checkpoint(self) -> Any:
        raise NotImplementedError(
            "ZeRO checkpoints of a model with expert-parallel MoE layers are not supported yet "
            "(expert shards live on their expert-data-parallel groups); save the weights with "
            "slipstream.moe.full_state_dict(engine.module) instead"
        )

    # The single-group views the ZeRO checkpoint code reads: refused rather than half-saved.
    masters = property(_no_checkpoint)
    specs = property(_no_checkpoint)
    params = property(_no_checkpoint)
