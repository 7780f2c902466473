"""Launcher environment detection for each launcher family (pure: no processes)."""

from __future__ import annotations

import pytest

from slipstream.comm.launch_env import LaunchEnvironment, detect_launch_environment


def test_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "1234",
    }
    assert detect_launch_environment(env) == LaunchEnvironment(
        "torchrun", 5, 8, 1, 4, "node0", 1234
    )


def test_torchrun_without_master_port_uses_distributed_port() -> None:
    got = detect_launch_environment(
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, distributed_port=4242
    )
    assert (got.local_rank, got.master_port, got.local_world_size) == (0, 4242, None)


def test_slurm_takes_master_from_first_node() -> None:
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_NODELIST": "gpu[07-08,11],cpu5",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    }
    got = detect_launch_environment(env)
    assert got == LaunchEnvironment("slurm", 6, 8, 2, 4, "gpu07", 29500)


def test_slurm_step_size_and_explicit_master_win() -> None:
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "a[1-4]",
        "SLURM_STEP_TASKS_PER_NODE": "2,1",
        "MASTER_ADDR": "10.0.0.9",
    }
    got = detect_launch_environment(env)
    assert (got.world_size, got.master_addr, got.local_world_size) == (2, "10.0.0.9", None)


def test_openmpi_without_master_addr_needs_discovery() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        # mpirun inside a SLURM allocation: these describe the batch step, not the MPI ranks.
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODELIST": "n1",
    }
    got = detect_launch_environment(env)
    assert got == LaunchEnvironment("openmpi", 3, 4, 1, 2, None, 29500)
    assert got.is_mpi


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
            ("pmi", 2, 3, 0, 1),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1"}, ("pmi", 1, 2, 1, None)),
        ({"PMIX_RANK": "1", "PMI_SIZE": "2"}, ("pmi", 1, 2, 0, None)),
        (
            {"PALS_RANKID": "5", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "1"},
            ("pals", 5, 8, 1, None),
        ),
        (
            {
                "MV2_COMM_WORLD_RANK": "1",
                "MV2_COMM_WORLD_SIZE": "2",
                "MV2_COMM_WORLD_LOCAL_RANK": "1",
            },
            ("mvapich", 1, 2, 1, None),
        ),
    ],
)
def test_mpich_intel_pmi_pals_mvapich(env: dict[str, str], expected: tuple) -> None:
    got = detect_launch_environment({**env, "MASTER_ADDR": "m"})
    assert (
        got.launcher,
        got.rank,
        got.world_size,
        got.local_rank,
        got.local_world_size,
    ) == expected
    assert got.master_addr == "m"


def test_torchrun_variables_win_over_mpi_and_slurm() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "1",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
    }
    assert detect_launch_environment(env).launcher == "torchrun"


def test_no_launcher_is_single_process_on_loopback() -> None:
    assert detect_launch_environment({}) == LaunchEnvironment(
        "single", 0, 1, 0, 1, "127.0.0.1", None
    )
    assert detect_launch_environment({"MASTER_PORT": "4000"}).master_port == 4000


def test_explicit_rank_and_world_size() -> None:
    got = detect_launch_environment({}, rank=1, world_size=3, distributed_port=5555)
    assert (got.launcher, got.rank, got.world_size, got.master_port) == ("explicit", 1, 3, 5555)


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, {}, r"outside \[0, 2\)"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, {}, "must be >= 1"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, {}, "not a TCP port"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, {}, "OMPI_COMM_WORLD_SIZE"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, {}, "SLURM_LOCALID"),
        ({}, {"rank": 0}, "both rank and world_size"),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_NODELIST": "a[1-",
            },
            {},
            "unclosed",
        ),
    ],
)
def test_bad_environments_say_what_is_wrong(
    env: dict[str, str], kwargs: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        detect_launch_environment(env, **kwargs)
