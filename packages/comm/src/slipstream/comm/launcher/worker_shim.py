"""Per-worker entry point: fill in torch's rank variables, add ``--local_rank``, run the user code.

``python -m slipstream.comm.launcher.worker_shim [--module | --no_python] [--no_local_rank]
target [args...]``. torch.distributed.run starts it for every local worker; srun and mpirun
start it directly, in which case it translates SLURM/MPI variables into ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR`` where derivable) first, so that scripts
using plain ``torch.distributed.init_process_group("env://")`` work under every launcher.
"""

from __future__ import annotations

import os
import runpy
import sys

from slipstream.comm.launch_env import detect_launch_environment
from slipstream.comm.launcher.environment import OMP_DEFAULTED_ENV, default_omp_threads

__all__ = ["main", "worker_argv"]

_USAGE = (
    "usage: python -m slipstream.comm.launcher.worker_shim [--module | --no_python] "
    "[--no_local_rank] target [args...]"
)


def worker_argv(target: str, args: list[str], local_rank: int, pass_local_rank: bool) -> list[str]:
    """The argv the user's program sees: DeepSpeed puts ``--local_rank=N`` right after it."""
    extra = [f"--local_rank={local_rank}"] if pass_local_rank else []
    return [target, *extra, *args]


def _export_rank_variables() -> int:
    """Set torch's rank variables from whichever launcher started us; return the local rank."""
    launch = detect_launch_environment(os.environ)
    os.environ.setdefault("RANK", str(launch.rank))
    os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
    os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    if launch.local_world_size is not None:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(launch.local_world_size))
        os.environ.setdefault("LOCAL_SIZE", str(launch.local_world_size))  # DeepSpeed's name
        threads = default_omp_threads(launch.local_world_size, os.environ)
        if threads is not None:
            # Set before the user's code imports torch, i.e. before OpenMP reads it.
            os.environ["OMP_NUM_THREADS"] = os.environ[OMP_DEFAULTED_ENV] = str(threads)
    if launch.master_addr is not None and launch.launcher != "single":
        os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    if launch.master_port is not None:
        os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    return launch.local_rank


def main(argv: list[str] | None = None) -> None:
    """Run the target as ``python script``, ``python -m module`` or an executable."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = "script"
    pass_local_rank = True
    while args and args[0].startswith("--"):
        flag = args.pop(0)
        if flag == "--module":
            mode = "module"
        elif flag == "--no_python":
            mode = "exec"
        elif flag == "--no_local_rank":
            pass_local_rank = False
        elif flag == "--":
            break
        else:
            raise SystemExit(f"worker_shim: unknown option {flag!r}\n{_USAGE}")
    if not args:
        raise SystemExit(f"worker_shim: no script, module or program given\n{_USAGE}")
    target, user_args = args[0], args[1:]
    local_rank = _export_rank_variables()
    new_argv = worker_argv(target, user_args, local_rank, pass_local_rank)

    if mode == "exec":
        os.execvp(target, new_argv)  # replaces this process, so the agent's pid stays valid
    sys.argv = new_argv
    if mode == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # What `python script.py` does: the script's folder comes first on sys.path.
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
