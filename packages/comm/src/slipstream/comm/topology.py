"""The process topology: ranks laid out on named axes (pipe × data × tensor) and their groups.

A :class:`ProcessTopology` is pure arithmetic (no process group needed): it maps a global rank
to a coordinate on each axis and back. A :class:`ProcessGrid` builds the torch.distributed
groups for one topology (one group per axis per fixed set of the other coordinates) and answers
the DeepSpeed ``mpu`` questions (``get_data_parallel_group()``, ...).

Axis order follows DeepSpeed: the last axis varies fastest, so with ``axes=("pipe", "data")``
the data-parallel replicas of one stage sit on consecutive ranks (one node keeps its DP
all-reduce local) and pipeline neighbours are ``num_dp`` ranks apart.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessGrid",
    "ProcessTopology",
]


class ProcessTopology:
    """Ranks laid out on a grid of named axes; the last axis varies fastest.

    Args:
        axes: axis names, e.g. ``["pipe", "data", "tensor"]``; unique.
        dims: the size of each axis; their product is the world size.

    >>> topo = ProcessTopology(axes=["pipe", "data"], dims=[2, 2])
    >>> topo.world_size(), topo.get_coord(3), topo.get_rank(pipe=1, data=0)
    (4, ProcessCoord(pipe=1, data=1), 2)
    >>> topo.get_axis_comm_lists("pipe")
    [[0, 2], [1, 3]]
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims) or not axes:
            raise ValueError(
                f"axes={axes} and dims={dims} must be non-empty and of the same length "
                "(one size per axis)"
            )
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes={axes} has repeated names; name each axis once")
        bad = [(a, d) for a, d in zip(axes, dims) if not isinstance(d, int) or d < 1]
        if bad:
            raise ValueError(f"axis sizes must be integers >= 1, got {bad}")
        self.axes: list[str] = axes
        self.dims: list[int] = dims
        self.ProcessCoord: Any = collections.namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        self._rank_of: dict[tuple[int, ...], int] = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in dims))):
            self._rank_of[coord] = rank

    def world_size(self) -> int:
        """Number of ranks: the product of the axis sizes."""
        return math.prod(self.dims)

    def get_dim(self, axis: str) -> int:
        """Size of ``axis``; 1 for an axis this topology does not have (it is implicit)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 1

    def get_rank(self, **coords: int) -> int:
        """Global rank at the coordinate given for every axis (``get_rank(pipe=1, data=0)``)."""
        missing = [a for a in self.axes if a not in coords]
        extra = [a for a in coords if a not in self.axes]
        if missing or extra:
            raise ValueError(
                f"get_rank needs exactly the axes {self.axes}: missing {missing}, unknown {extra}"
            )
        key = tuple(coords[a] for a in self.axes)
        if key not in self._rank_of:
            raise ValueError(
                f"coordinate {coords} is outside the grid {dict(zip(self.axes, self.dims))}"
            )
        return self._rank_of[key]

    def get_coord(self, rank: int) -> Any:
        """The coordinate (a named tuple with one field per axis) of global ``rank``."""
        if not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank} is outside this topology of {self.world_size()} ranks")
        coord = []
        for dim in reversed(self.dims):
            coord.append(rank % dim)
            rank //= dim
        return self.ProcessCoord(*reversed(coord))

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on ``axis`` is ``idx``, ascending."""
        if axis not in self.axes:
            raise ValueError(f"unknown axis {axis!r}; this topology has {self.axes}")
        return [r for r in range(self.world_size()) if getattr(self.get_coord(r), axis) == idx]

    def filter_match(self, **filters: int) -> list[int]:
        """Ranks whose coordinates equal every given ``axis=value``, ascending."""
        return [
            r
            for r in range(self.world_size())
            if all(getattr(self.get_coord(r), a) == v for a, v in filters.items())
        ]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups along ``axis``: ranks that differ only in their ``axis`` coordinate.

        Returns one list per combination of the other axes (ordered by global rank), each
        list ordered by its ``axis`` coordinate; ``[]`` for an axis the topology lacks.
        """
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return sorted(lists)

    def __repr__(self) -> str:
        return f"ProcessTopology(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline × data parallelism: ``axes=["pipe", "data"]``.

    >>> PipeDataParallelTopology(num_pp=2, num_dp=2).get_axis_comm_lists("data")
    [[0, 1], [2, 3]]
    """

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline × data × tensor parallelism: ``axes=["pipe", "data", "tensor"]``.

    Tensor-parallel ranks are adjacent (they exchange the most data, so they share a node).
    """

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "tensor"], dims=[num_pp, num_dp, num_mp])


class ProcessGrid:
    """The torch.distributed groups of a topology, and this rank's place in them.

    Every rank must construct it (group creation is collective), with the same topology.
    The grid answers the DeepSpeed ``mpu`` interface, so it can be passed as
    ``slipstream.initialize(mpu=grid)``.

    Attributes:
        topology: the :class:`ProcessTopology`.
        global_rank: this process's rank in the world.
        stage_id: this rank's pipeline stage (its ``pipe`` coordinate).
        data_parallel_id: its ``data`` coordinate.
        pipe_parallel_size, data_parallel_size, model_parallel_size: the axis sizes.

    >>> grid = ProcessGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))  # doctest: +SKIP
    >>> grid.get_stage_id(), grid.stage_to_global(1)  # on rank 1  # doctest: +SKIP
    (0, 3)
    """

    def __init__(self, topology: ProcessTopology, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGrid needs torch.distributed to be initialised first: call "
                "slipstream.comm.init_distributed()"
            )
        world = dist.get_world_size()
        if topology.world_size() != world:
            raise ValueError(
                f"{topology} covers {topology.world_size()} ranks but the world has {world}; "
                "choose axis sizes whose product is the world size"
            )
        self.topology = topology
        self.global_rank = dist.get_rank()
        coord = topology.get_coord(self.global_rank)
        self.stage_id = int(getattr(coord, "pipe", 0))
        self.data_parallel_id = int(getattr(coord, "data", 0))
        self.tensor_parallel_id = int(getattr(coord, "tensor", 0))
        self.pipe_parallel_size = topology.get_dim("pipe")
        self.data_parallel_size = topology.get_dim("data")
        self.model_parallel_size = topology.get_dim("tensor")
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._group_ranks: dict[str, list[int]] = {}
        # new_group is collective over the world: every rank creates every group, in the same
        # order, and keeps the one it belongs to.
        for axis in ("pipe", "data", "tensor"):
            lists = topology.get_axis_comm_lists(axis) or [[r] for r in range(world)]
            for ranks in lists:
                made = dist.new_group(ranks) if len(ranks) > 1 else None
                if self.global_rank in ranks:
                    self._groups[axis] = made
                    self._group_ranks[axis] = ranks

    # ------------------------------------------------------------------ queries
    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The group along ``axis`` containing this rank (None when the axis has size 1)."""
        return self._groups[axis]

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, ordered by that axis."""
        return list(self._group_ranks[axis])

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def stage_to_global(self, stage_id: int) -> int:
        """Global rank of pipeline stage ``stage_id`` in this rank's pipeline."""
        return self._group_ranks["pipe"][stage_id]

    def is_first_stage(self) -> bool:
        """Whether this rank holds pipeline stage 0."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage."""
        return self.stage_id == self.pipe_parallel_size - 1

    # DeepSpeed's mpu interface.
    def get_pipe_parallel_group(self) -> dist.ProcessGroup | None:
        """Group of this rank's pipeline (one rank per stage)."""
        return self._groups["pipe"]

    def get_pipe_parallel_rank(self) -> int:
        """This rank's stage."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """Number of pipeline stages."""
        return self.pipe_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup | None:
        """Group of this stage's data-parallel replicas."""
        return self._groups["data"]

    def get_data_parallel_rank(self) -> int:
        """This rank's data-parallel index."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """Number of data-parallel replicas."""
        return self.data_parallel_size

    def get_model_parallel_group(self) -> dist.ProcessGroup | None:
        """Group of this rank's tensor-parallel peers."""
        return self._groups["tensor"]

    def get_model_parallel_rank(self) -> int:
        """This rank's tensor-parallel index."""
        return self.tensor_parallel_id

    def get_model_parallel_world_size(self) -> int:
        """Tensor-parallel degree."""
        return self.model_parallel_size

    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
