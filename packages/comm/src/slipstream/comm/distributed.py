"""Process-group set-up under any launcher (torchrun, SLURM, MPI, none) and rank queries."""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch.distributed as dist

from slipstream.comm import _device, in_flight
from slipstream.comm.launch_env import DEFAULT_PORT, LaunchEnvironment, detect_launch_environment

__all__ = [
    "destroy",
    "free_port",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
]

logger = logging.getLogger(__name__)

# What init_distributed resolved; None until it has run in this process.
_launch: LaunchEnvironment | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it; another process may take
    it before it is used, so callers that can retry on "address in use" should)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _mpi_master_addr() -> str:
    """Rank 0's host name, broadcast over MPI (needs mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            "started by an MPI launcher without MASTER_ADDR, and mpi4py is not installed to "
            "discover rank 0's host; export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) to "
            "every rank (mpirun -x MASTER_ADDR=..., or -genv for MPICH), or pip install mpi4py"
        ) from None
    world = MPI.COMM_WORLD
    host = socket.getfqdn() if world.Get_rank() == 0 else None
    return str(world.bcast(host, root=0))


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    return datetime.timedelta(seconds=float(timeout))


def _set_local_device(local_rank: int, backend: str) -> None:
    count = _device.device_count()
    if count == 0:
        return
    if count == 1:
        # One visible device per process (e.g. `srun --gpus-per-task=1`): it is device 0.
        _device.set_device(0)
    elif local_rank < count:
        _device.set_device(local_rank)
    elif backend != "gloo":
        raise RuntimeError(
            f"local rank {local_rank} has no device: only {count} are visible on this node; "
            "start at most one process per device, or restrict CUDA_VISIBLE_DEVICES per process"
        )
    # gloo with more ranks than devices (CPU tests on a GPU host) runs fine without one.


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise torch.distributed for whichever launcher started this process.

    Works under torchrun / torch elastic / ``slipstream run`` (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), SLURM ``srun`` (rendezvous on the first host
    of ``SLURM_NODELIST``), OpenMPI, MVAPICH2, Cray PALS and MPICH / Intel MPI (PMI), and with no
    launcher at all (world size 1 on a free loopback port). See
    :func:`slipstream.comm.launch_env.detect_launch_environment` for the precedence.

    After it returns, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` are set in ``os.environ`` (as torchrun would have), and on a GPU the current
    device is ``LOCAL_RANK``. Calling it again once initialised does nothing.

    Args:
        dist_backend: ``"nccl"``, ``"gloo"``, ...; default: the accelerator's (nccl on CUDA and
            ROCm, gloo on CPU).
        auto_mpi_discovery: under MPI without ``MASTER_ADDR``, broadcast rank 0's host name
            with mpi4py. When False (or mpi4py is missing) that case is an error.
        distributed_port: rendezvous port when ``MASTER_PORT`` is not set.
        verbose: log the resulting layout on rank 0.
        timeout: collective timeout (a timedelta or seconds); default torch's.
        init_method: a torch ``init_method`` URL (``tcp://``, ``file://``); default ``env://``.
        dist_init_required: False skips initialisation (the caller owns it); None or True
            initialise unless already initialised.
        rank: explicit global rank (with `world_size`), overriding the environment.
        world_size: explicit world size (with `rank`).

    >>> from slipstream import comm
    >>> comm.init_distributed(dist_backend="gloo", verbose=False)  # no launcher: world size 1
    >>> comm.get_rank(), comm.get_world_size()
    (0, 1)
    >>> comm.destroy()
    """
    global _launch
    if is_initialized():
        if _launch is None:
            _launch = detect_launch_environment(os.environ, distributed_port=distributed_port)
        logger.debug("torch.distributed is already initialised; init_distributed does nothing")
        return
    if dist_init_required is False:
        logger.info("dist_init_required=False: leaving torch.distributed uninitialised")
        return

    launch = detect_launch_environment(
        os.environ, rank=rank, world_size=world_size, distributed_port=distributed_port
    )
    master_addr = launch.master_addr
    if master_addr is None:
        if launch.world_size == 1:
            master_addr = "127.0.0.1"
        elif auto_mpi_discovery:
            master_addr = _mpi_master_addr()
        else:
            raise RuntimeError(
                f"started by {launch.launcher} (world size {launch.world_size}) without "
                "MASTER_ADDR and auto_mpi_discovery=False; export MASTER_ADDR=<host of rank 0> "
                "to every rank"
            )
    master_port = launch.master_port or free_port()
    launch = LaunchEnvironment(
        launcher=launch.launcher,
        rank=launch.rank,
        world_size=launch.world_size,
        local_rank=launch.local_rank,
        local_world_size=launch.local_world_size,
        master_addr=master_addr,
        master_port=master_port,
    )

    os.environ["RANK"] = str(launch.rank)
    os.environ["WORLD_SIZE"] = str(launch.world_size)
    os.environ["LOCAL_RANK"] = str(launch.local_rank)
    if launch.local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(launch.local_world_size)
    if init_method is None:
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)

    backend = dist_backend or _device.communication_backend()
    if _device.device_type() != "cpu":
        _set_local_device(launch.local_rank, backend)
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=_as_timedelta(timeout),
    )
    _launch = launch
    if verbose and launch.rank == 0:
        logger.info(
            "initialised torch.distributed: backend=%s world_size=%d launcher=%s rendezvous=%s",
            backend,
            launch.world_size,
            launch.launcher,
            init_method or f"{master_addr}:{master_port}",
        )


def is_initialized() -> bool:
    """True once a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (default: the world); 0 when not initialised."""
    if not is_initialized():
        if group is not None:
            raise RuntimeError("get_rank(group) needs init_distributed() to have run first")
        return 0
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of processes in `group` (default: the world); 1 when not initialised."""
    if not is_initialized():
        if group is not None:
            raise RuntimeError("get_world_size(group) needs init_distributed() to have run first")
        return 1
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """Rank of this process among those on its node (``LOCAL_RANK``); 0 without a launcher."""
    if _launch is not None:
        return _launch.local_rank
    return detect_launch_environment(os.environ).local_rank


def destroy() -> None:
    """Tear down the default process group (if any) so that a new one can be initialised.

    First waits until torch's communication threads have released the tensors of every
    collective issued through :mod:`slipstream.comm`, so that none of them is left to be freed
    while the interpreter exits (see ``slipstream/comm/in_flight.py``).
    """
    global _launch
    in_flight.drain()
    if is_initialized():
        dist.destroy_process_group()
    _launch = None
