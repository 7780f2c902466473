"""Commands that start a job on several nodes through pdsh, ssh, srun or mpirun.

pdsh and ssh start one node-local ``slipstream run`` per host (``--node_rank`` tells it which
entry of the shared layout it is), which then runs torch.distributed.run there; all nodes meet
at ``master_addr:master_port``. srun and mpirun start every worker themselves, through the
worker shim, which reads the rank from the SLURM/MPI variables.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys

from slipstream.comm.launcher.resources import Resources, encode_world_info

__all__ = ["LAUNCHERS", "MultiNodeJob", "NodeCommand", "build_commands", "kill_commands"]

LAUNCHERS = ("pdsh", "ssh", "slurm", "openmpi", "mpich")
PDSH_FAN_OUT = 1024
SHIM_MODULE = "slipstream.comm.launcher.worker_shim"
LAUNCHER_MODULE = "slipstream.comm.launcher"


@dataclasses.dataclass(frozen=True)
class MultiNodeJob:
    """Everything the per-launcher builders need.

    Attributes:
        resources: host -> slots in rank order; ``None`` hosts (srun/mpirun inside an
            allocation without a hostfile) are given as an empty dict with `nodes` and
            `procs_per_node` set instead.
        nodes: number of nodes when `resources` is empty.
        procs_per_node: processes per node when `resources` is empty.
    """

    launcher: str
    resources: Resources
    target: str
    target_args: list[str]
    master_addr: str | None
    master_port: int
    exports: dict[str, str]
    cwd: str
    run_id: str
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    launcher_args: list[str] = dataclasses.field(default_factory=list)
    nodes: int = 0
    procs_per_node: int = 0
    python: str = sys.executable


@dataclasses.dataclass(frozen=True)
class NodeCommand:
    """One command to run on this machine (`env` is added to its environment)."""

    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def shell(self) -> str:
        """The command as a shell line, for --dry_run."""
        prefix = [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        return " ".join(prefix + [shlex.quote(arg) for arg in self.argv])


def _mode_flags(job: MultiNodeJob) -> list[str]:
    flags = []
    if job.module:
        flags.append("--module")
    if job.no_python:
        flags.append("--no_python")
    if job.no_local_rank:
        flags.append("--no_local_rank")
    return flags


def _node_launcher(job: MultiNodeJob, node_rank: str) -> list[str]:
    argv = [
        job.python,
        "-u",
        "-m",
        LAUNCHER_MODULE,
        f"--world_info={encode_world_info(job.resources)}",
        f"--node_rank={node_rank}",
        f"--master_addr={job.master_addr}",
        f"--master_port={job.master_port}",
        f"--run_id={job.run_id}",
        *_mode_flags(job),
        "--",
        job.target,
        *job.target_args,
    ]
    return argv


def _remote_shell(job: MultiNodeJob, argv: list[str]) -> str:
    exports = "".join(f"export {key}={shlex.quote(value)}; " for key, value in job.exports.items())
    return f"{exports}cd {shlex.quote(job.cwd)} && {' '.join(shlex.quote(arg) for arg in argv)}"


def _shim(job: MultiNodeJob) -> list[str]:
    return [
        job.python,
        "-u",
        "-m",
        SHIM_MODULE,
        *_mode_flags(job),
        "--",
        job.target,
        *job.target_args,
    ]


def _layout(job: MultiNodeJob) -> tuple[list[str] | None, list[int]]:
    if job.resources:
        return list(job.resources), [len(slots) for slots in job.resources.values()]
    return None, [job.procs_per_node] * job.nodes


def _check_mpi_slots(job: MultiNodeJob) -> None:
    for host, slots in job.resources.items():
        if slots != list(range(len(slots))):
            raise ValueError(
                f"--launcher {job.launcher} starts workers itself and cannot pin host {host!r} to "
                f"device slots {slots}; use --launcher pdsh or ssh (which set "
                "CUDA_VISIBLE_DEVICES per node), or select whole hosts / leading slots only"
            )


def _uniform(job: MultiNodeJob, counts: list[int]) -> int:
    if len(set(counts)) != 1:
        raise ValueError(
            f"--launcher {job.launcher} needs the same number of processes on every node, got "
            f"{dict(zip(job.resources, counts))}; use --num_procs, or --launcher openmpi / pdsh"
        )
    return counts[0]


def _rendezvous_env(job: MultiNodeJob) -> dict[str, str]:
    env = {"MASTER_PORT": str(job.master_port)}
    if job.master_addr:
        env["MASTER_ADDR"] = job.master_addr
    return env


def build_commands(job: MultiNodeJob) -> list[NodeCommand]:
    """The local commands that start `job` on all its nodes (several only for ssh)."""
    if job.launcher == "pdsh":
        host_list = ",".join(job.resources)
        # pdsh substitutes %n with each host's index in the -w list: its node rank.
        remote = _remote_shell(job, _node_launcher(job, "%n"))
        argv = ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", host_list, *job.launcher_args, remote]
        return [NodeCommand(argv, {"PDSH_RCMD_TYPE": "ssh"})]

    if job.launcher == "ssh":
        return [
            NodeCommand(
                [
                    "ssh",
                    *job.launcher_args,
                    host,
                    _remote_shell(job, _node_launcher(job, str(rank))),
                ]
            )
            for rank, host in enumerate(job.resources)
        ]

    hosts, counts = _layout(job)
    total = sum(counts)
    _check_mpi_slots(job)
    if job.launcher == "slurm":
        per_node = _uniform(job, counts)
        argv = [
            "srun",
            f"--nodes={len(counts)}",
            f"--ntasks-per-node={per_node}",
            f"--ntasks={total}",
        ]
        if hosts is not None:
            argv.append(f"--nodelist={','.join(hosts)}")
        # srun forwards this process's whole environment (--export=ALL is its default).
        env = {**job.exports, **_rendezvous_env(job)}
        return [NodeCommand([*argv, *job.launcher_args, *_shim(job)], env)]

    if job.launcher == "openmpi":
        argv = ["mpirun", "-np", str(total), "--bind-to", "none"]
        if hosts is not None:
            argv += ["-H", ",".join(f"{host}:{count}" for host, count in zip(hosts, counts))]
        else:
            argv += ["--npernode", str(_uniform(job, counts))]
        argv += ["-x", "PATH", "-x", "LD_LIBRARY_PATH"]
        for key, value in {**job.exports, **_rendezvous_env(job)}.items():
            argv += ["-x", f"{key}={value}"]
        return [NodeCommand([*argv, *job.launcher_args, *_shim(job)])]

    if job.launcher == "mpich":
        argv = ["mpirun", "-n", str(total), "-ppn", str(_uniform(job, counts))]
        if hosts is not None:
            argv += ["-hosts", ",".join(hosts)]
        for key, value in {**job.exports, **_rendezvous_env(job)}.items():
            argv += ["-genv", key, value]
        return [NodeCommand([*argv, *job.launcher_args, *_shim(job)])]

    raise ValueError(f"--launcher {job.launcher!r} is not one of {', '.join(LAUNCHERS)}")


def kill_commands(job: MultiNodeJob) -> list[NodeCommand]:
    """Commands that stop this job's node launchers (pdsh/ssh) on every host, found by run id.

    Killing the local pdsh/ssh client does not stop remote processes; the run id in their
    command line lets ``pkill -f`` hit exactly this job's launchers and nothing else.
    """
    pattern = f"run_id={job.run_id}"
    if job.launcher == "pdsh":
        host_list = ",".join(job.resources)
        argv = [
            "pdsh",
            "-f",
            str(PDSH_FAN_OUT),
            "-w",
            host_list,
            *job.launcher_args,
            f"pkill -f {pattern}",
        ]
        return [NodeCommand(argv, {"PDSH_RCMD_TYPE": "ssh"})]
    if job.launcher == "ssh":
        return [
            NodeCommand(["ssh", *job.launcher_args, host, f"pkill -f {pattern}"])
            for host in job.resources
        ]
    return []
