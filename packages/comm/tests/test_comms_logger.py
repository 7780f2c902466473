"""CommsLogger bookkeeping, config handling and the single-process init path (in-process)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from slipstream import comm
from slipstream.comm.comms_logger import CommsLogger, bus_bandwidth_factor
from slipstream.comm.config import CommsLoggerConfig
from slipstream.kernels.config_schema import ConfigError


@pytest.mark.parametrize(
    ("op", "n", "factor"),
    [
        ("all_reduce", 4, 2 * 3 / 4),
        ("all_reduce", 1, 0.0),
        ("all_gather_into_tensor", 8, 7 / 8),
        ("reduce_scatter_tensor", 2, 1 / 2),
        ("all_to_all_single", 4, 3 / 4),
        ("broadcast", 4, 1.0),
        ("send", 2, 1.0),
        ("barrier", 4, 0.0),
    ],
)
def test_bus_bandwidth_factors_follow_nccl_tests(op: str, n: int, factor: float) -> None:
    assert bus_bandwidth_factor(op, n) == pytest.approx(factor)


def test_record_accumulates_count_bytes_latency_and_bandwidths() -> None:
    logger = CommsLogger()
    logger.record("all_reduce", "all_reduce", 1000, 0.002, group_size=4)
    logger.record("all_reduce", "all_reduce", 1000, 0.003, group_size=2)
    logger.record("all_reduce", "all_reduce", 64, 0.001, group_size=4, async_op=True)
    stats = logger.records["all_reduce"][1000]
    assert (stats.count, stats.total_bytes, stats.async_count) == (2, 2000, 0)
    assert stats.total_latency_s == pytest.approx(0.005)
    assert (stats.min_latency_s, stats.max_latency_s) == (0.002, 0.003)
    assert stats.avg_latency_s == pytest.approx(0.0025)
    assert stats.algbw == pytest.approx(2000 / 0.005)
    # busbw weighs each call by its own group size: 1000*1.5 + 1000*1.0 bytes over the bus.
    assert stats.busbw == pytest.approx((1000 * 1.5 + 1000 * 1.0) / 0.005)
    assert logger.records["all_reduce"][64].async_count == 1

    table = logger.format_summary()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["op", "size", "count"]
    row = next(line for line in lines if "1000 B" in line)
    assert row.split()[3] == "2" and float(row.split()[4]) == pytest.approx(5.0)  # count, total ms
    assert any(line.startswith("all_reduce*") for line in lines)
    assert "timed at issue only" in table

    logger.reset()
    assert logger.records == {} and "no communication recorded" in logger.format_summary()


def test_configure_from_config_block_dict_and_keywords() -> None:
    logger = CommsLogger()
    assert (logger.enabled, logger.prof_all, logger.verbose, logger.debug) == (
        False,
        True,
        False,
        False,
    )
    logger.configure({"enabled": True, "prof_all": False, "prof_ops": ["broadcast"]})
    assert logger.enabled and not logger.prof_all and logger.prof_ops == {"broadcast"}
    logger.configure(CommsLoggerConfig(enabled=False, verbose=True))
    assert not logger.enabled and logger.verbose and logger.prof_all and logger.prof_ops == set()
    logger.configure(enabled=True, debug=True)
    assert logger.enabled and logger.debug and logger.verbose
    with pytest.raises(ConfigError, match=r"comms_logger\.prof_al"):
        logger.configure({"prof_al": True})
    with pytest.raises(TypeError, match="list of op names"):
        logger.configure(prof_ops="all_reduce")


def test_config_block_defaults_match_deepspeed() -> None:
    assert CommsLoggerConfig.from_dict({}).to_dict() == {
        "enabled": False,
        "verbose": False,
        "prof_all": True,
        "debug": False,
        "prof_ops": [],
    }


def _reduce_from_helper(tensor: torch.Tensor) -> None:
    comm.all_reduce(tensor)


@pytest.fixture
def clean_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # init_distributed exports these; set-then-delete makes monkeypatch remove them afterwards.
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    yield
    comm.destroy()
    comm.comms_logger.configure(CommsLoggerConfig())
    comm.comms_logger.reset()


def test_single_process_init_and_logged_ops(
    clean_launch_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    comm.init_distributed(dist_backend="gloo", verbose=False)
    assert comm.is_initialized()
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank()) == (0, 1, 0)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
    comm.init_distributed(dist_backend="gloo")  # idempotent

    tensor = torch.ones(4)
    comm.all_reduce(tensor)
    assert comm.comms_logger.records == {}  # disabled: nothing recorded

    comm.configure(enabled=True, prof_all=False, prof_ops=["broadcast"], verbose=True)
    with caplog.at_level(logging.INFO, logger="slipstream.comm.comms_logger"):
        comm.all_reduce(tensor)
        comm.broadcast(tensor, src=0)
        comm.all_reduce(tensor, prof=True)
        comm.barrier(log_name="broadcast")  # recorded under its log_name, which is listed
    assert set(comm.comms_logger.records) == {"broadcast", "all_reduce"}
    assert comm.comms_logger.records["all_reduce"][16].count == 1  # only the prof=True call
    assert set(comm.comms_logger.records["broadcast"]) == {16, 0}
    assert "comm op broadcast" in caplog.text

    comm.comms_logger.reset()
    comm.configure(prof_all=True, debug=True, verbose=False)
    _reduce_from_helper(tensor)
    assert list(comm.comms_logger.records) == ["all_reduce | [caller: _reduce_from_helper]"]
    assert tensor.tolist() == [1.0] * 4  # world size 1: the sum is the tensor itself
    with caplog.at_level(logging.INFO, logger="slipstream.comm.comms_logger"):
        table = comm.log_summary()
    assert "_reduce_from_helper" in table and "communication summary" in caplog.text

    comm.destroy()
    assert not comm.is_initialized()


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("mpi4py") is not None,
    reason="with mpi4py installed, discovery would try to talk to MPI",
)
def test_mpi_without_master_addr_says_to_set_it(
    clean_launch_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"export MASTER_ADDR=.*pip install mpi4py"):
        comm.init_distributed(dist_backend="gloo")
    with pytest.raises(RuntimeError, match="auto_mpi_discovery=False"):
        comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    assert not comm.is_initialized()
