"""Gradients of expert-parallel MoE parameters in the engine (slipstream.moe, ``ep_size > 1``).

The engine finds them here and hands the layout to slipstream.zero's gradient path (stage 0:
``ReplicatedGradientPath``'s expert groups; stages 1-3: ``MultiGroupPath``, the dense part over
the data-parallel group, one part per expert group over its expert-data-parallel group).

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
expert-DP group when sharded and then over the expert-parallel group. Sharded, every element
lives on exactly one rank of the world, so ZeRO's norm is one all-reduce over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from slipstream import comm

__all__ = ["ExpertLayout", "declare_stage3_reads", "expert_layout"]


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


def declare_stage3_reads(model: torch.nn.Module) -> None:
    """ZeRO stage 3: declare the parameters slipstream.moe's modules read from a child without
    calling it (``TopKGate`` reads ``wg.weight`` in fp32 itself), so that stage 3 gathers them
    around the reading module's forward (``register_external_parameter``)."""
    from slipstream.moe import TopKGate
    from slipstream.zero import register_external_parameter

    for module in model.modules():
        if isinstance(module, TopKGate):
            for param in module.wg.parameters():
                register_external_parameter(module, param)
