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
from slipstream.comm.deepspeed_names import (
    P2POp,
    ProcessGroup,
    ReduceOp,
    all_gather,
    all_gather_object,
    all_to_all,
    allgather_fn,
    batch_isend_irecv,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_all_ranks_from_group,
    get_global_rank,
    get_world_group,
    has_all_gather_into_tensor,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    irecv,
    is_available,
    isend,
    monitored_barrier,
    new_group,
    reduce,
    reduce_scatter,
    reduce_scatter_fn,
    scatter,
)
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
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "bus_bandwidth_factor",
    "comms_logger",
    "configure",
    "destroy",
    "destroy_process_group",
    "detect_launch_environment",
    "expand_nodelist",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


def configure(config: CommsLoggerConfig | None = None, **settings: object) -> None:
    """Configure the comms logger (DeepSpeed's ``deepspeed.comm.configure``); see
    :meth:`CommsLogger.configure`."""
    comms_logger.configure(config, **settings)  # type: ignore[arg-type]


def log_summary() -> str:
    """Log the communication summary table on rank 0 and return it."""
    return comms_logger.log_summary()
