"""Process groups, logged collectives, the launcher and the multi-process test harness.

>>> from slipstream import comm
>>> comm.init_distributed()          # torchrun, SLURM, MPI or a plain `python train.py`
>>> comm.comms_logger.configure(enabled=True)
>>> comm.all_reduce(tensor)          # torch.distributed.all_reduce, timed and recorded
>>> comm.log_summary()               # per-op table on rank 0
"""

from __future__ import annotations

from slipstream.comm.collectives import (
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    recv,
    reduce_scatter_tensor,
    send,
)
from slipstream.comm.comms_logger import CommsLogger, CommsStats, bus_bandwidth_factor, comms_logger
from slipstream.comm.config import CommsLoggerConfig
from slipstream.comm.distributed import (
    destroy,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)
from slipstream.comm.hostlist import expand_nodelist
from slipstream.comm.launch_env import LaunchEnvironment, detect_launch_environment

__all__ = [
    "CommsLogger",
    "CommsLoggerConfig",
    "CommsStats",
    "LaunchEnvironment",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "bus_bandwidth_factor",
    "comms_logger",
    "configure",
    "destroy",
    "detect_launch_environment",
    "expand_nodelist",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "log_summary",
    "recv",
    "reduce_scatter_tensor",
    "send",
]


def configure(config: CommsLoggerConfig | None = None, **settings: object) -> None:
    """Configure the comms logger (DeepSpeed's ``deepspeed.comm.configure``); see
    :meth:`CommsLogger.configure`."""
    comms_logger.configure(config, **settings)  # type: ignore[arg-type]


def log_summary() -> str:
    """Log the communication summary table on rank 0 and return it."""
    return comms_logger.log_summary()
