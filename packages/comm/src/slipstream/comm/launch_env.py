"""Read rank, world size and rendezvous address from whichever launcher started this process.

This module is pure (a mapping in, a dataclass out) and imports neither torch nor MPI, so that it
can be tested without processes and used by the light worker shim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from slipstream.comm.hostlist import expand_nodelist

__all__ = ["DEFAULT_PORT", "LaunchEnvironment", "detect_launch_environment"]

DEFAULT_PORT = 29500


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """Where this process sits in the job, as told by its launcher.

    Attributes:
        launcher: which family set the variables: ``"torchrun"`` (also the Slipstream launcher and
            anything else setting ``RANK``/``WORLD_SIZE``), ``"openmpi"``, ``"mvapich"``,
            ``"pals"``, ``"pmi"`` (MPICH, Intel MPI, PMIx), ``"slurm"``, ``"explicit"`` (rank and
            world size passed as arguments) or ``"single"`` (no launcher: one process).
        rank: global rank.
        world_size: number of processes in the job.
        local_rank: rank among the processes of this node.
        local_world_size: processes on this node, where the launcher says (else ``None``).
        master_addr: the rendezvous host, or ``None`` when it must still be discovered (MPI
            without ``MASTER_ADDR``).
        master_port: the rendezvous port, or ``None`` for a free loopback port (single process).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None

    @property
    def is_mpi(self) -> bool:
        """True when an MPI launcher started the process (so mpi4py discovery may apply)."""
        return self.launcher in {"openmpi", "mvapich", "pals", "pmi"}


# Each MPI family: the variables for (rank, size, local rank, local size), first one present wins.
_MPI_FAMILIES: tuple[
    tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...
] = (
    (
        "openmpi",
        ("OMPI_COMM_WORLD_RANK",),
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    (
        "mvapich",
        ("MV2_COMM_WORLD_RANK",),
        ("MV2_COMM_WORLD_SIZE",),
        ("MV2_COMM_WORLD_LOCAL_RANK",),
        ("MV2_COMM_WORLD_LOCAL_SIZE",),
    ),
    (
        "pals",
        ("PALS_RANKID",),
        ("PALS_SIZE", "PMI_SIZE"),
        ("PALS_LOCAL_RANKID",),
        ("PALS_LOCAL_SIZE",),
    ),
    (
        "pmi",
        ("PMI_RANK", "PMIX_RANK"),
        ("PMI_SIZE",),
        ("MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"),
        ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
    ),
)


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def _as_int(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; unset it or fix the "
            "launcher that set it"
        ) from None
    if number < 0:
        raise ValueError(f"environment variable {name}={value!r} must not be negative")
    return number


def _read_int(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    found = _first(environ, names)
    return None if found is None else _as_int(*found)


def _require_int(environ: Mapping[str, str], names: tuple[str, ...], family: str) -> int:
    value = _read_int(environ, names)
    if value is None:
        raise ValueError(
            f"the {family} launcher set some of its variables but not {' or '.join(names)}; "
            "export it, or set RANK, WORLD_SIZE and LOCAL_RANK yourself"
        )
    return value


def _port(environ: Mapping[str, str], default: int | None) -> int | None:
    value = _read_int(environ, ("MASTER_PORT",))
    if value is not None and not 0 < value < 65536:
        raise ValueError(f"MASTER_PORT={value} is not a TCP port (1-65535)")
    return default if value is None else value


def _slurm_first_host(environ: Mapping[str, str]) -> str | None:
    found = _first(environ, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    return None if found is None else expand_nodelist(found[1])[0]


def _slurm_local_size(environ: Mapping[str, str]) -> int | None:
    # SLURM_STEP_TASKS_PER_NODE reads like "4(x2),3"; only a uniform layout gives one number.
    found = _first(environ, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if found is None:
        return None
    counts = {part.split("(")[0] for part in found[1].split(",")}
    if len(counts) == 1:
        count = counts.pop()
        return int(count) if count.isdigit() else None
    return None


def detect_launch_environment(
    environ: Mapping[str, str],
    *,
    rank: int = -1,
    world_size: int = -1,
    distributed_port: int = DEFAULT_PORT,
) -> LaunchEnvironment:
    """Work out this process's place in the job from its environment variables.

    Order of precedence (the first family whose variables are present wins):

    1. ``RANK`` and ``WORLD_SIZE`` (torchrun, torch elastic, the Slipstream launcher);
    2. OpenMPI (``OMPI_COMM_WORLD_*``), MVAPICH2 (``MV2_COMM_WORLD_*``), Cray PALS
       (``PALS_*``), then MPICH / Intel MPI / PMIx (``PMI_RANK``, ``PMI_SIZE``,
       ``MPI_LOCALRANKID``);
    3. SLURM (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the rendezvous host is
       the first host of ``SLURM_NODELIST``);
    4. nothing: a single process (world size 1) on loopback.

    MPI comes before SLURM because ``mpirun`` inside a SLURM allocation inherits the
    allocation's SLURM variables, which then describe the batch step rather than the MPI ranks.
    ``MASTER_ADDR``/``MASTER_PORT`` from the environment always win over derived values.
    ``rank``/``world_size`` (when not -1) override what the environment says.

    Args:
        environ: the environment to read (usually ``os.environ``).
        rank: explicit global rank, or -1 to read it from the environment.
        world_size: explicit world size, or -1 to read it from the environment.
        distributed_port: the port to use when ``MASTER_PORT`` is not set.

    Raises:
        ValueError: on contradictory or malformed values (the message names the variable).
    """
    if (rank == -1) != (world_size == -1):
        raise ValueError(
            f"pass both rank and world_size, or neither (got rank={rank}, world_size={world_size})"
        )
    master_addr = environ.get("MASTER_ADDR") or None
    result: LaunchEnvironment | None = None

    if _first(environ, ("RANK",)) and _first(environ, ("WORLD_SIZE",)):
        local_rank = _read_int(environ, ("LOCAL_RANK",))
        result = LaunchEnvironment(
            launcher="torchrun",
            rank=_require_int(environ, ("RANK",), "torchrun"),
            world_size=_require_int(environ, ("WORLD_SIZE",), "torchrun"),
            local_rank=0 if local_rank is None else local_rank,
            local_world_size=_read_int(environ, ("LOCAL_WORLD_SIZE",)),
            master_addr=master_addr,
            master_port=_port(environ, distributed_port),
        )

    if result is None:
        for family, rank_vars, size_vars, local_vars, local_size_vars in _MPI_FAMILIES:
            if _first(environ, rank_vars) is None:
                continue
            local_rank = _read_int(environ, local_vars)
            result = LaunchEnvironment(
                launcher=family,
                rank=_require_int(environ, rank_vars, family),
                world_size=_require_int(environ, size_vars, family),
                local_rank=0 if local_rank is None else local_rank,
                local_world_size=_read_int(environ, local_size_vars),
                master_addr=master_addr,
                master_port=_port(environ, distributed_port),
            )
            break

    if result is None and _first(environ, ("SLURM_PROCID",)):
        result = LaunchEnvironment(
            launcher="slurm",
            rank=_require_int(environ, ("SLURM_PROCID",), "slurm"),
            world_size=_require_int(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), "slurm"),
            local_rank=_require_int(environ, ("SLURM_LOCALID",), "slurm"),
            local_world_size=_slurm_local_size(environ),
            master_addr=master_addr or _slurm_first_host(environ),
            master_port=_port(environ, distributed_port),
        )

    if result is None:
        result = LaunchEnvironment(
            launcher="single",
            rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            master_addr=master_addr or "127.0.0.1",
            # No launcher chose a port: a free one is picked at init so that several
            # single-process runs on one machine do not collide on 29500.
            master_port=_port(environ, None),
        )

    if rank != -1:
        result = dataclasses.replace(
            result,
            launcher="explicit" if result.launcher == "single" else result.launcher,
            rank=rank,
            world_size=world_size,
            master_port=result.master_port if result.master_port else distributed_port,
        )

    if result.world_size < 1:
        raise ValueError(f"world size {result.world_size} from {result.launcher} must be >= 1")
    if not 0 <= result.rank < result.world_size:
        raise ValueError(
            f"rank {result.rank} from {result.launcher} is outside [0, {result.world_size}); "
            "check RANK/WORLD_SIZE (or the launcher's equivalents)"
        )
    return result
