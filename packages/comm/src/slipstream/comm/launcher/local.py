"""Run this node's workers with torch.distributed.run (in-process, so exit codes survive)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import sys
from collections.abc import Iterable, Iterator, Mapping

from slipstream.comm.launcher.multinode import SHIM_MODULE

__all__ = ["LocalPlan", "run_local", "worst_exit_code"]


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """One node's share of a job.

    Attributes:
        nnodes: nodes in the job; node_rank: this node's index among them.
        nproc: workers on this node.
        env: variables added to the workers' environment (OMP_NUM_THREADS, device
            visibility, exports).
    """

    nnodes: int
    node_rank: int
    nproc: int
    master_addr: str
    master_port: int
    target: str
    target_args: list[str]
    env: dict[str, str]
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False

    def shim_args(self) -> list[str]:
        """The worker shim's arguments: mode flags, then the user's target and its args."""
        flags = []
        if self.module:
            flags.append("--module")
        if self.no_python:
            flags.append("--no_python")
        if self.no_local_rank:
            flags.append("--no_local_rank")
        return [*flags, "--", self.target, *self.target_args]

    def torchrun_args(self) -> list[str]:
        """Arguments of ``python -m torch.distributed.run`` that run this plan."""
        return [
            f"--nnodes={self.nnodes}",
            f"--nproc_per_node={self.nproc}",
            f"--node_rank={self.node_rank}",
            f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
            # Static rendezvous: a fixed set of nodes meeting at master_addr:master_port,
            # like DeepSpeed's launcher (elastic membership is torchrun's own business).
            "--rdzv_backend=static",
            "--max_restarts=0",
            "--module",
            SHIM_MODULE,
            *self.shim_args(),
        ]

    def shell(self) -> str:
        """The equivalent shell command, for --dry_run."""
        prefix = [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        argv = [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args()]
        return " ".join(prefix + [shlex.quote(arg) for arg in argv])


def worst_exit_code(codes: Iterable[int]) -> int:
    """The exit status to report for several workers: the largest, with a death by signal N
    counted as 128 + N (what a shell reports); 0 when there are no codes.

    Deaths by SIGTERM or SIGKILL are left out when another worker failed on its own: those are
    the workers that torch.distributed.run stopped because of that failure.
    """
    codes = list(codes)
    stopped = {-signal.SIGTERM, -signal.SIGKILL}
    own = [code for code in codes if code not in stopped]
    if any(own):
        codes = own
    mapped = [128 - code if code < 0 else code for code in codes]
    return max(mapped, default=0)


@contextlib.contextmanager
def _patched_environ(overrides: Mapping[str, str]) -> Iterator[None]:
    # torch.distributed.run gives workers a copy of os.environ; patch it only for the run so
    # that main() leaves its caller's environment as it found it.
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _restored_signal_handlers() -> Iterator[None]:
    # torch elastic installs SIGINT/SIGTERM handlers that raise inside the agent and does not
    # remove them afterwards.
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    numbers = [getattr(signal, name) for name in names if hasattr(signal, name)]
    saved = {number: signal.getsignal(number) for number in numbers}
    try:
        yield
    finally:
        for number, handler in saved.items():
            if handler is not None:
                signal.signal(number, handler)


def run_local(plan: LocalPlan) -> int:
    """Start the plan's workers, wait for them, return the worst exit code (0 on success).

    Ctrl-C or SIGTERM stops every worker and returns 128 + the signal number.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(plan.torchrun_args())
    with _patched_environ(plan.env), _restored_signal_handlers():
        try:
            run(args)
        except ChildFailedError as error:
            return worst_exit_code(failure.exitcode for failure in error.failures.values()) or 1
        except SignalException as error:
            return 128 + int(error.sigval)
        except KeyboardInterrupt:
            return 128 + signal.SIGINT
    return 0
