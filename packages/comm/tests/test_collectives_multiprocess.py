"""Logged collectives on 1, 2 and 4 spawned gloo ranks, checked against hand-computed values."""

from __future__ import annotations

import os

import pytest
import torch

from slipstream import comm
from slipstream.comm.testing import DistributedTestError, distributed_test, run_distributed

pytestmark = pytest.mark.slow


def _check_collectives(tag: str) -> dict:
    """Run every wrapper once (logging on) and return what each rank saw; asserts inline."""
    rank, n = comm.get_rank(), comm.get_world_size()
    assert (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) == (rank, n)
    assert comm.get_local_rank() == rank and os.environ["OMP_NUM_THREADS"] == "1"
    comm.configure(enabled=True, prof_all=True)
    triangle = n * (n + 1) / 2  # sum over ranks of (rank + 1)

    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    comm.all_reduce(x)
    assert x.tolist() == [triangle, 2 * triangle]

    y = torch.full((4,), float(rank + 1))
    work = comm.all_reduce(y, async_op=True)
    work.wait()
    assert y.tolist() == [triangle] * 4

    gathered = torch.empty(2 * n)
    comm.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    assert gathered.tolist() == [float(r) for r in range(n) for _ in range(2)]

    shard = torch.empty(2)
    comm.reduce_scatter_tensor(shard, torch.arange(2.0 * n) * (rank + 1))
    assert shard.tolist() == [triangle * 2 * rank, triangle * (2 * rank + 1)]

    b = torch.full((3,), float(rank))
    comm.broadcast(b, src=n - 1)
    assert b.tolist() == [float(n - 1)] * 3

    sent = torch.tensor([10.0 * rank + j for j in range(n)])
    received = torch.empty(n)
    comm.all_to_all_single(received, sent)
    assert received.tolist() == [10.0 * j + rank for j in range(n)]

    if n > 1:
        # Even ranks send first, odd ranks receive first: a ring of blocking calls that cannot
        # deadlock.
        out, got = torch.tensor([float(rank)]), torch.empty(1)
        right, left = (rank + 1) % n, (rank - 1) % n
        if rank % 2 == 0:
            comm.send(out, right)
            sender = comm.recv(got, left)
        else:
            sender = comm.recv(got, left)
            comm.send(out, right)
        assert got.item() == float(left) and sender == left

    comm.barrier()
    records = comm.comms_logger.records
    counts = {name: {size: s.count for size, s in sizes.items()} for name, sizes in records.items()}
    bus = {
        name: {size: s.bus_bytes for size, s in sizes.items()} for name, sizes in records.items()
    }
    asyncs = records["all_reduce"][16].async_count
    table = comm.log_summary()
    return {"tag": tag, "counts": counts, "bus": bus, "async": asyncs, "table": table}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_logged_collectives(world_size: int) -> None:
    n = world_size
    results = run_distributed(_check_collectives, world_size, "hello", timeout=90)
    assert [r["tag"] for r in results] == ["hello"] * n
    expected_counts = {
        "all_reduce": {8: 1, 16: 1},
        "all_gather_into_tensor": {8 * n: 1},
        "reduce_scatter_tensor": {8 * n: 1},
        "broadcast": {12: 1},
        "all_to_all_single": {4 * n: 1},
        "barrier": {0: 1},
    }
    if n > 1:
        expected_counts.update(send={4: 1}, recv={4: 1})
    for result in results:
        assert result["counts"] == expected_counts
        assert result["async"] == 1
        # nccl-tests factors applied to the bytes: hand-computed per op.
        assert result["bus"]["all_reduce"][8] == pytest.approx(8 * 2 * (n - 1) / n)
        assert result["bus"]["all_gather_into_tensor"][8 * n] == pytest.approx(8 * n * (n - 1) / n)
        assert result["bus"]["broadcast"][12] == pytest.approx(12)
        assert "all_reduce*" in result["table"]


def _fail_on_last_rank(message: str) -> None:
    if comm.get_rank() == comm.get_world_size() - 1:
        raise RuntimeError(message)
    comm.barrier()  # the other ranks block here until the harness kills them


def test_failing_rank_traceback_reaches_the_parent() -> None:
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_fail_on_last_rank, 2, "boom from the last rank", timeout=60)
    text = str(caught.value)
    assert text.index("rank 1 of 2 raised") < text.find("rank 0") or "rank 0" not in text
    assert "RuntimeError: boom from the last rank" in text
    assert "_fail_on_last_rank" in text  # the child's traceback, not the parent's


def test_run_distributed_rejects_local_functions() -> None:
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(local, 2)


@distributed_test(world_size=2)
def test_decorated_test_runs_on_every_rank(tmp_path) -> None:
    (tmp_path / f"rank{comm.get_rank()}").write_text(str(comm.get_world_size()))
    comm.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def _die_on_last_rank() -> None:
    if comm.get_rank() == comm.get_world_size() - 1:
        os._exit(7)
    comm.barrier()


def test_dead_rank_is_reported_without_waiting_for_the_timeout() -> None:
    with pytest.raises(DistributedTestError, match="rank 1 exited with code 7 without returning"):
        run_distributed(_die_on_last_rank, 2, timeout=60)


def _sleep_forever() -> None:
    import time

    time.sleep(3600)


def test_hanging_rank_times_out() -> None:
    with pytest.raises(
        DistributedTestError, match=r"timed out after 6 s waiting for rank\(s\) \[0\]"
    ):
        run_distributed(_sleep_forever, 1, timeout=6)
