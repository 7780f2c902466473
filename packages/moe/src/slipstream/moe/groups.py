"""The expert-parallel and expert-data-parallel process groups, one layout per ``ep_size``.

For a world of ``W`` ranks and ``ep_size = E`` (E divides W):

* expert-parallel (EP) groups are ``W / E`` blocks of ``E`` consecutive ranks
  (``[0..E-1], [E..2E-1], ...``). The experts of a layer are sharded across one EP group and
  tokens travel between its ranks by all-to-all. Consecutive ranks share a node first, so the
  all-to-all stays on the fastest links.
* expert-data-parallel (expert-DP) groups hold the ranks with the same position in each EP
  group (``{0, E, 2E, ...}, {1, E+1, ...}``): they own the same experts and all-reduce those
  experts' gradients.

Dense (non-expert) parameters are replicated on every rank and reduce over the whole world.
This is DeepSpeed's default layout (``use_data_before_expert_parallelism = false``).

``torch.distributed.new_group`` is collective: every rank must ask for the same ``ep_size``
values in the same order, which holds when every rank builds the same model.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from slipstream import comm

__all__ = [
    "ExpertParallelGroups",
    "expert_group_name",
    "get_expert_data_parallel_group",
    "get_expert_parallel_group",
    "get_expert_parallel_groups",
    "reset_expert_parallel_groups",
]


@dataclasses.dataclass(frozen=True)
class ExpertParallelGroups:
    """The process groups of one ``ep_size`` as seen from this rank.

    Attributes:
        name: ``"ep_size_<E>"``, the ``group_name`` stamped on expert parameters and the name
            of their optimizer parameter group.
        ep_size: ranks per expert-parallel group.
        world_size: ranks in the world (1 without torch.distributed).
        ep_group: this rank's expert-parallel group (None when ``ep_size == 1``: no all-to-all).
        ep_rank: this rank's index in `ep_group`; it owns experts
            ``[ep_rank · local, (ep_rank + 1) · local)`` of each layer.
        expert_dp_group: this rank's expert-data-parallel group (None means the whole world, as
            when ``ep_size == 1``).
        expert_dp_size: ranks in `expert_dp_group` (``world_size / ep_size``).
    """

    name: str
    ep_size: int
    world_size: int
    ep_group: dist.ProcessGroup | None
    ep_rank: int
    expert_dp_group: dist.ProcessGroup | None
    expert_dp_size: int


_GROUPS: dict[int, ExpertParallelGroups] = {}
# The default group the cache was built under: a new init_distributed() invalidates it.
_WORLD_OF_CACHE: list[object] = [None]


def expert_group_name(ep_size: int) -> str:
    """The name of the expert groups of `ep_size` (``"ep_size_2"``), as DeepSpeed names them."""
    return f"ep_size_{ep_size}"


def get_expert_parallel_groups(ep_size: int) -> ExpertParallelGroups:
    """The groups for `ep_size`, created on first use (collectively: see the module docstring).

    Raises:
        ValueError: `ep_size` < 1 or it does not divide the world size.
        RuntimeError: ``ep_size > 1`` before torch.distributed is initialised.
    """
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1")
    world = dist.group.WORLD if comm.is_initialized() else None
    if world is not _WORLD_OF_CACHE[0]:
        _GROUPS.clear()
        _WORLD_OF_CACHE[0] = world
    cached = _GROUPS.get(ep_size)
    if cached is not None:
        return cached
    world_size = comm.get_world_size()
    if ep_size > 1 and not comm.is_initialized():
        raise RuntimeError(
            f"ep_size={ep_size} needs torch.distributed: call slipstream.comm.init_distributed() "
            "(or launch with torchrun / slipstream run) before building the MoE layers"
        )
    if world_size % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the world size {world_size}: choose an ep_size "
            f"among the divisors of {world_size}"
        )
    name = expert_group_name(ep_size)
    if ep_size == 1:
        groups = ExpertParallelGroups(name, 1, world_size, None, 0, None, world_size)
    else:
        rank = comm.get_rank()
        ep_group = expert_dp_group = None
        # Every rank creates every group, in the same order (new_group is collective).
        for first in range(0, world_size, ep_size):
            ranks = list(range(first, first + ep_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                ep_group = group
        for position in range(ep_size):
            ranks = list(range(position, world_size, ep_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                expert_dp_group = group
        groups = ExpertParallelGroups(
            name=name,
            ep_size=ep_size,
            world_size=world_size,
            ep_group=ep_group,
            ep_rank=rank % ep_size,
            expert_dp_group=expert_dp_group,
            expert_dp_size=world_size // ep_size,
        )
    _GROUPS[ep_size] = groups
    return groups


def _groups_named(group_name: str) -> ExpertParallelGroups:
    for groups in _GROUPS.values():
        if groups.name == group_name:
            return groups
    known = ", ".join(sorted(g.name for g in _GROUPS.values())) or "none yet"
    raise KeyError(
        f"no expert groups named {group_name!r} in this process (known: {known}); build the "
        "MoE layers (which create their groups) before asking for their groups"
    )


def get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    """The expert-DP group of an expert parameter's ``group_name`` (None: the whole world).

    This is what a gradient reducer or a ZeRO optimizer calls to find where a MoE parameter
    group's gradients are reduced.
    """
    return _groups_named(group_name).expert_dp_group


def get_expert_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    """The expert-parallel group of an expert parameter's ``group_name`` (None: ep_size 1).

    Its ranks hold disjoint experts, so sums over all experts (gradient norms) reduce over it.
    """
    return _groups_named(group_name).ep_group


def reset_expert_parallel_groups() -> None:
    """Forget the cached groups (after ``comm.destroy()``, before a new process group)."""
    _GROUPS.clear()
