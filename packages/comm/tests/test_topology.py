"""ProcessTopology arithmetic, and ProcessGrid's groups on 4 spawned gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slipstream.comm.testing import run_distributed
from slipstream.comm.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessGrid,
    ProcessTopology,
)


def test_rank_and_coordinate_are_inverse():
    topo = ProcessTopology(axes=["pipe", "data", "tensor"], dims=[2, 3, 2])
    assert topo.world_size() == 12
    for rank in range(12):
        coord = topo.get_coord(rank)
        assert topo.get_rank(**coord._asdict()) == rank
    # The last axis varies fastest.
    assert topo.get_coord(1) == (0, 0, 1) and topo.get_coord(2) == (0, 1, 0)
    assert topo.get_coord(11)._asdict() == {"pipe": 1, "data": 2, "tensor": 1}


def test_axis_lists():
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_axis_comm_lists("tensor") == []
    assert topo.get_axis_list("pipe", 1) == [3, 4, 5]
    assert topo.filter_match(data=1) == [1, 4]
    assert topo.get_dim("tensor") == 1
    three = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert three.axes == ["pipe", "data", "tensor"]
    assert three.get_axis_comm_lists("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert three.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="same length"):
        ProcessTopology(["pipe"], [2, 2])
    with pytest.raises(ValueError, match="repeated"):
        ProcessTopology(["pipe", "pipe"], [2, 2])
    with pytest.raises(ValueError, match=">= 1"):
        ProcessTopology(["pipe"], [0])
    topo = PipeDataParallelTopology(2, 2)
    with pytest.raises(ValueError, match="missing"):
        topo.get_rank(pipe=1)
    with pytest.raises(ValueError, match="outside the grid"):
        topo.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="outside this topology"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match="unknown axis"):
        topo.get_axis_list("tensor", 0)
    with pytest.raises(RuntimeError, match="init_distributed"):
        ProcessGrid(topo)


def _grid_groups():
    grid = ProcessGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    rank = dist.get_rank()
    seen = {}
    for axis in ("pipe", "data", "tensor"):
        value = torch.tensor([float(rank)])
        group = grid.group(axis)
        if group is not None:
            dist.all_reduce(value, group=group)
        seen[axis] = (value.item(), grid.group_ranks(axis))
    return {
        "seen": seen,
        "stage": grid.get_stage_id(),
        "tp": grid.get_model_parallel_rank(),
        "dp_size": grid.get_data_parallel_world_size(),
        "first": grid.is_first_stage(),
        "last": grid.is_last_stage(),
        "next": grid.stage_to_global(1),
    }


@pytest.mark.slow
def test_grid_groups_on_four_ranks():
    results = run_distributed(_grid_groups, 4)
    # Ranks: (pipe, data, tensor) = (0,0,0) (0,0,1) (1,0,0) (1,0,1).
    for rank, info in enumerate(results):
        stage, tp = divmod(rank, 2)
        assert (info["stage"], info["tp"], info["dp_size"]) == (stage, tp, 1)
        assert info["first"] == (stage == 0) and info["last"] == (stage == 1)
        pipe_ranks = [tp, tp + 2]
        assert info["seen"]["pipe"] == (float(sum(pipe_ranks)), pipe_ranks)
        assert info["seen"]["tensor"] == (float(2 * stage * 2 + 1), [2 * stage, 2 * stage + 1])
        assert info["seen"]["data"] == (float(rank), [rank])
        assert info["next"] == tp + 2
    with pytest.raises(Exception, match="covers 4 ranks but the world has 2"):
        run_distributed(_wrong_size, 2)


def _wrong_size():
    ProcessGrid(PipeDataParallelTopology(2, 2))
