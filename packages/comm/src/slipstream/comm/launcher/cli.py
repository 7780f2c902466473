"""``slipstream run``: argument parsing and the choice between a local and a multi-node launch."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slipstream.comm.launch_env import DEFAULT_PORT
from slipstream.comm.launcher.environment import (
    OMP_DEFAULTED_ENV,
    collect_exports,
    cpu_cores,
    default_omp_threads,
)
from slipstream.comm.launcher.local import LocalPlan, run_local, worst_exit_code
from slipstream.comm.launcher.multinode import (
    LAUNCHERS,
    MultiNodeJob,
    NodeCommand,
    build_commands,
    kill_commands,
)
from slipstream.comm.launcher.resources import (
    Resources,
    decode_world_info,
    filter_resources,
    limit_resources,
    parse_hostfile,
)

__all__ = ["DEFAULT_HOSTFILE", "build_parser", "main"]

logger = logging.getLogger(__name__)

DEFAULT_HOSTFILE = "/job/hostfile"
_LAUNCHER_BINARIES = {
    "pdsh": "pdsh",
    "ssh": "ssh",
    "slurm": "srun",
    "openmpi": "mpirun",
    "mpich": "mpirun",
}


class _UsageError(ValueError):
    """A bad combination of options; reported as one line and exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The ``slipstream run`` argument parser (DeepSpeed's launcher options)."""
    parser = argparse.ArgumentParser(
        prog="slipstream run",
        description=(
            "Start a training script on every device of one or several nodes. Each worker gets "
            "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and --local_rank=N "
            "as its first argument (unless --no_local_rank)."
        ),
    )
    parser.add_argument(
        "-H",
        "--hostfile",
        default=None,
        help=f"hostfile ('hostname slots=N' per line); default {DEFAULT_HOSTFILE} if it exists, "
        "else this machine only",
    )
    parser.add_argument(
        "-i", "--include", default="", help="use only these hosts/slots: 'worker-0:0,2@worker-1'"
    )
    parser.add_argument(
        "-e", "--exclude", default="", help="skip these hosts/slots, same syntax as --include"
    )
    parser.add_argument(
        "--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile"
    )
    parser.add_argument(
        "--num_procs",
        "--num_gpus",
        "--num_accelerators",
        dest="num_procs",
        type=int,
        default=-1,
        help="processes per node (slots 0..N-1); default: the hostfile's slots, else the number "
        "of visible GPUs, else 1 on a CPU-only machine",
    )
    parser.add_argument(
        "--master_addr",
        default="",
        help="rendezvous host; default the first host (127.0.0.1 on one node)",
    )
    parser.add_argument(
        "--master_port",
        type=int,
        default=DEFAULT_PORT,
        help="rendezvous port (default %(default)s)",
    )
    parser.add_argument(
        "--launcher", default="pdsh", choices=LAUNCHERS, help="multi-node launcher (default pdsh)"
    )
    parser.add_argument(
        "--launcher_args", default="", help="extra arguments for the launcher, as one quoted string"
    )
    parser.add_argument(
        "--module", action="store_true", help="the target is a module to run like 'python -m'"
    )
    parser.add_argument(
        "--no_python", action="store_true", help="the target is an executable, not a Python script"
    )
    parser.add_argument(
        "--no_local_rank", action="store_true", help="do not pass --local_rank=N to the target"
    )
    parser.add_argument(
        "--force_multi", action="store_true", help="use the multi-node launcher even for one host"
    )
    parser.add_argument(
        "--dry_run", action="store_true", help="print the commands that would run and exit"
    )
    # Set by the multi-node launchers on each node; also usable by hand (one call per node).
    parser.add_argument("--node_rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--world_info", default="", help=argparse.SUPPRESS)
    parser.add_argument("--run_id", default="", help=argparse.SUPPRESS)
    parser.add_argument(
        "target", help="training script (or module with --module, executable with --no_python)"
    )
    parser.add_argument("target_args", nargs=argparse.REMAINDER, help="arguments for the target")
    return parser


def _default_local_procs() -> int:
    from slipstream.comm import _device

    return _device.device_count() or 1


def _visible_devices_variable() -> str:
    from slipstream.comm import _device

    return "HIP_VISIBLE_DEVICES" if _device.accelerator_name() == "rocm" else "CUDA_VISIBLE_DEVICES"


def _device_env(slots: list[int]) -> dict[str, str]:
    """Restrict this node's workers to `slots` when they are not simply 0..n-1."""
    if slots == list(range(len(slots))):
        return {}
    variable = _visible_devices_variable()
    visible = os.environ.get(variable)
    if visible:
        # Slots index the devices the user already made visible, not the physical ones.
        ids = [item.strip() for item in visible.split(",")]
        if max(slots) >= len(ids):
            raise _UsageError(f"slot {max(slots)} is beyond {variable}={visible}")
        return {variable: ",".join(ids[slot] for slot in slots)}
    return {variable: ",".join(str(slot) for slot in slots)}


def _worker_env(nproc: int, slots: list[int]) -> dict[str, str]:
    # Local workers inherit this environment; only what differs from it is worth setting.
    env = {
        key: value
        for key, value in collect_exports(os.environ).items()
        if os.environ.get(key) != value
    }
    env.update(_device_env(slots))
    threads = default_omp_threads(nproc, {**os.environ, **env})
    if threads is not None:
        logger.info(
            "OMP_NUM_THREADS is not set: using %d (%d cores // %d processes on this node)",
            threads,
            cpu_cores(),
            nproc,
        )
        env["OMP_NUM_THREADS"] = env[OMP_DEFAULTED_ENV] = str(threads)
    return env


def _load_pool(hostfile: str | None) -> Resources | None:
    path = hostfile or (DEFAULT_HOSTFILE if os.path.isfile(DEFAULT_HOSTFILE) else None)
    if path is None:
        return None
    if not os.path.isfile(path):
        raise _UsageError(
            f"--hostfile {path} does not exist; pass an existing file or leave it out"
        )
    hosts = parse_hostfile(Path(path).read_text(), source=path)
    logger.info("using hostfile %s: %s", path, ", ".join(f"{h}={n}" for h, n in hosts.items()))
    return {host: list(range(slots)) for host, slots in hosts.items()}


def _check_target(args: argparse.Namespace) -> None:
    if not args.module and not args.no_python and not os.path.isfile(args.target):
        raise _UsageError(
            f"script {args.target!r} not found (from {os.getcwd()}); give a path to a .py file, "
            "or --module for a module name"
        )


def _node_plan(args: argparse.Namespace) -> LocalPlan:
    """This node's plan when started as one node of a job (--node_rank given)."""
    if args.world_info:
        layout = decode_world_info(args.world_info)
        if not 0 <= args.node_rank < len(layout):
            raise _UsageError(
                f"--node_rank {args.node_rank} is outside the {len(layout)} nodes of --world_info"
            )
        slots = list(layout.values())[args.node_rank]
        nnodes = len(layout)
    else:
        nnodes = args.num_nodes if args.num_nodes > 0 else 1
        if args.node_rank >= nnodes:
            raise _UsageError(f"--node_rank {args.node_rank} needs --num_nodes > {args.node_rank}")
        slots = list(range(args.num_procs if args.num_procs > 0 else _default_local_procs()))
    if nnodes > 1 and not args.master_addr:
        raise _UsageError("--node_rank with several nodes needs --master_addr (the host of node 0)")
    return LocalPlan(
        nnodes=nnodes,
        node_rank=args.node_rank,
        nproc=len(slots),
        master_addr=args.master_addr or "127.0.0.1",
        master_port=args.master_port,
        target=args.target,
        target_args=args.target_args,
        env=_worker_env(len(slots), slots),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
    )


def _active_resources(args: argparse.Namespace, pool: Resources | None) -> Resources:
    if (args.include or args.exclude) and (args.num_nodes != -1 or args.num_procs != -1):
        raise _UsageError(
            "--include/--exclude cannot be combined with --num_nodes/--num_procs; "
            "select hosts and slots with one or the other"
        )
    if pool is None:
        if args.num_nodes > 1:
            raise _UsageError(
                f"--num_nodes {args.num_nodes} needs a hostfile listing the nodes (--hostfile), "
                "or --launcher slurm/openmpi/mpich inside an allocation"
            )
        pool = {"localhost": list(range(_default_local_procs()))}
    active = filter_resources(pool, args.include, args.exclude)
    return limit_resources(active, args.num_nodes, args.num_procs)


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived while the job was running."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _run_commands(job: MultiNodeJob, commands: list[NodeCommand]) -> int:
    binary = _LAUNCHER_BINARIES[job.launcher]
    if shutil.which(binary) is None:
        raise _UsageError(
            f"--launcher {job.launcher} needs '{binary}' on PATH; install it or pick another launcher"
        )
    processes = [
        subprocess.Popen(command.argv, env={**os.environ, **command.env}) for command in commands
    ]
    try:
        with _signals_as_interrupt():
            codes = [process.wait() for process in processes]
    except _Interrupted as interrupt:
        logger.warning("interrupted: stopping the job on every node")
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for command in kill_commands(job):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    command.argv, env={**os.environ, **command.env}, timeout=60, check=False
                )
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        return 128 + interrupt.signum
    return worst_exit_code(codes)


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    previous = {
        number: signal.signal(number, handler) for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def _multinode_job(
    args: argparse.Namespace, active: Resources, pool: Resources | None
) -> MultiNodeJob:
    import shlex

    resources = active
    nodes = procs = 0
    if pool is None:
        # srun/mpirun inside an allocation: no host names, the launcher places the workers.
        resources = {}
        nodes = args.num_nodes if args.num_nodes > 0 else 1
        procs = len(next(iter(active.values())))
    master_addr = args.master_addr or (next(iter(resources)) if resources else None)
    return MultiNodeJob(
        launcher=args.launcher,
        resources=resources,
        target=args.target,
        target_args=args.target_args,
        master_addr=master_addr,
        master_port=args.master_port,
        exports=collect_exports(os.environ),
        cwd=os.getcwd(),
        run_id=args.run_id or uuid.uuid4().hex,
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        launcher_args=shlex.split(args.launcher_args),
        nodes=nodes,
        procs_per_node=procs,
    )


def _launch(args: argparse.Namespace) -> int:
    if args.module and args.no_python:
        raise _UsageError("--module and --no_python exclude each other: a module is run by Python")
    if args.target_args[:1] == ["--"]:
        args.target_args = args.target_args[1:]

    if args.node_rank >= 0:
        plan = _node_plan(args)
        if args.dry_run:
            print(plan.shell())
            return 0
        _check_target(args)
        return run_local(plan)

    pool = _load_pool(args.hostfile)
    mpi_in_allocation = pool is None and args.launcher in {"slurm", "openmpi", "mpich"}
    if mpi_in_allocation and (args.num_nodes > 1 or args.force_multi):
        if args.include or args.exclude:
            raise _UsageError("--include/--exclude select hosts of a hostfile; pass --hostfile too")
        active = limit_resources(
            {"allocation": list(range(_default_local_procs()))}, 1, args.num_procs
        )
        job = _multinode_job(args, active, None)
    else:
        active = _active_resources(args, pool)
        if len(active) == 1 and not args.force_multi:
            slots = next(iter(active.values()))
            plan = LocalPlan(
                nnodes=1,
                node_rank=0,
                nproc=len(slots),
                master_addr=args.master_addr or "127.0.0.1",
                master_port=args.master_port,
                target=args.target,
                target_args=args.target_args,
                env=_worker_env(len(slots), slots),
                module=args.module,
                no_python=args.no_python,
                no_local_rank=args.no_local_rank,
            )
            if args.dry_run:
                print(plan.shell())
                return 0
            _check_target(args)
            return run_local(plan)
        job = _multinode_job(args, active, pool)

    commands = build_commands(job)
    if args.dry_run:
        for command in commands:
            print(command.shell())
        return 0
    return _run_commands(job, commands)


def main(argv: list[str] | None = None) -> int:
    """Run ``slipstream run`` with `argv` (default ``sys.argv[1:]``); return the exit status.

    The status is the worst worker exit code (a worker killed by signal N counts as 128 + N),
    130 after Ctrl-C, and 2 for invalid options.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="[slipstream run] %(levelname)s: %(message)s"
        )
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _launch(args)
    except (_UsageError, ValueError) as error:
        print(f"slipstream run: error: {error}", file=sys.stderr)
        return 2
