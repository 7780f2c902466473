"""Run a function in N fresh processes with a process group, for multi-process tests on CPU.

Test modules are collected with ``--import-mode=importlib``, so child processes cannot import
them by name: the function travels as (source file, qualified name) and each child loads that
file under a unique module name. Only module-level functions qualify, and arguments and return
values must be picklable. Children are spawned, never forked (torch's OpenMP and threads do not
survive fork).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import multiprocessing
import os
import pickle
import queue
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["DistributedTestError", "count_host_reads", "distributed_test", "run_distributed"]

_F = TypeVar("_F", bound=Callable[..., Any])

# Set on a function by `distributed_test`: the child runs the undecorated body.
_INNER_ATTR = "__slipstream_distributed_inner__"
# How long a child that exited may take to deliver its result through the queue.
_EXIT_GRACE_S = 2.0
# After the first failure, how long to keep collecting other ranks' reports.
_FAILURE_DRAIN_S = 1.0


class DistributedTestError(AssertionError):
    """A rank failed, died or timed out; the message holds its traceback."""


def _locate(fn: Callable[..., Any]) -> tuple[str, str]:
    """(source file, qualified name) of a module-level function, or a clear error."""
    qualname = getattr(fn, "__qualname__", "")
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"run_distributed needs a module-level function (got {qualname or fn!r}); "
            "move it to the top level of its module so that child processes can load it"
        )
    source = inspect.getsourcefile(inspect.unwrap(fn))
    if source is None or not os.path.isfile(source):
        raise TypeError(f"cannot find the source file of {qualname}; define it in a .py file")
    return os.path.abspath(source), qualname


def _load(source: str, qualname: str) -> Callable[..., Any]:
    """Load `source` under a fresh module name and return the object at `qualname`."""
    module_name = f"_slipstream_dist_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(module_name, source)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {source} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets pickle and dataclasses resolve the module
    spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return getattr(target, _INNER_ATTR, target)


def _child_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    source: str,
    qualname: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    """Entry point of each spawned rank: set the env, init the group, run, report."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torch was imported (by this module) before the variable was set, so it is not read any
    # more: apply it directly. Without this, N ranks on fewer cores oversubscribe every op.
    import torch

    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    initialised = False
    try:
        from slipstream.comm.distributed import destroy, init_distributed

        init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
        initialised = True
        fn = _load(source, qualname)
        value = fn(*args, **kwargs)
        # Pickled here with the standard pickler: a tensor is copied into the bytes instead of
        # being shared through memory this process owns (which vanishes when it exits, before
        # the parent may have read it).
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if initialised:
            try:
                destroy()
            except Exception:
                pass


def _port_in_use(text: str) -> bool:
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _terminate(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(1.0)


def _run_once(
    source: str,
    qualname: str,
    world_size: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str,
    timeout: float,
) -> list[Any]:
    from slipstream.comm.distributed import free_port

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_child_main,
            args=(
                rank,
                world_size,
                port,
                backend,
                timeout,
                source,
                qualname,
                args,
                kwargs,
                results,
            ),
            name=f"slipstream-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()

    values: dict[int, Any] = {}
    # rank -> (priority, message); a rank that died outright is usually the root cause of
    # the others' errors (their collectives lose a peer), so it is reported first.
    failures: dict[int, tuple[int, str]] = {}
    exited_at: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    first_failure_at = 0.0
    finished = False
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if failures and now - first_failure_at > _FAILURE_DRAIN_S:
                break
            if not failures and now > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                failures[-1] = (
                    2,
                    f"timed out after {timeout:.0f} s waiting for rank(s) {missing} of "
                    f"{world_size} (a collective that not every rank entered?)",
                )
                break
            try:
                rank, ok, payload = results.get(timeout=0.05)
            except queue.Empty:
                for rank, process in enumerate(processes):
                    if rank in values or rank in failures or process.is_alive():
                        continue
                    exited_at.setdefault(rank, now)
                    if process.exitcode or now - exited_at[rank] > _EXIT_GRACE_S:
                        failures[rank] = (
                            0,
                            f"rank {rank} exited with code {process.exitcode} without "
                            "returning (killed, os._exit, or a crash in native code; see its "
                            "stderr above)",
                        )
            else:
                if ok:
                    values[rank] = pickle.loads(payload)
                else:
                    failures[rank] = (1, f"rank {rank} of {world_size} raised:\n{payload}")
            if failures and not first_failure_at:
                # Wait briefly for the other ranks' reports before killing them.
                first_failure_at = time.monotonic()
        finished = not failures
    finally:
        if finished:
            # Every rank returned: give them time to tear the group down before forcing it.
            for process in processes:
                process.join(10.0)
        _terminate(processes)
        results.close()
    if failures:
        # Stable sort: within a priority, the first report (likely the cause) stays first.
        ordered = sorted(failures.values(), key=lambda item: item[0])
        report = "\n\n".join(message for _, message in ordered)
        raise DistributedTestError(f"{qualname} in {source}: {report}")
    return [values[rank] for rank in range(world_size)]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run module-level ``fn(*args, **kwargs)`` on `world_size` spawned ranks; return their results.

    Each rank gets ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` and ``OMP_NUM_THREADS=1`` (unless set), and a default process group
    initialised through :func:`slipstream.comm.init_distributed` with `backend`. Children
    share the caller's stdout/stderr. Spawning costs about a second per rank (each imports
    torch), so put many checks into one call.

    Returns:
        The return values, indexed by rank.

    Raises:
        DistributedTestError: (an AssertionError) when a rank raises, dies or the run exceeds
            `timeout` seconds; the message holds the failing rank's traceback and the other
            ranks are killed.

    >>> def check_sum():            # at module level in a test file
    ...     t = torch.ones(2) * (dist.get_rank() + 1)
    ...     dist.all_reduce(t)
    ...     return t.tolist()
    >>> run_distributed(check_sum, 2)  # doctest: +SKIP
    [[3.0, 3.0], [3.0, 3.0]]
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    source, qualname = _locate(fn)
    try:
        return _run_once(source, qualname, world_size, args, kwargs, backend, timeout)
    except DistributedTestError as error:
        # The free port can be taken between choosing it and binding it; one retry covers that.
        if not _port_in_use(str(error)):
            raise
    return _run_once(source, qualname, world_size, args, kwargs, backend, timeout)


def distributed_test(
    world_size: int, *, backend: str = "gloo", timeout: float = 120.0
) -> Callable[[_F], _F]:
    """Decorate a module-level test so that its body runs on `world_size` ranks.

    The test's arguments (pytest fixtures such as ``tmp_path``) are passed to every rank and
    must be picklable; a failure on any rank fails the test with that rank's traceback.

    >>> @distributed_test(world_size=2)  # doctest: +SKIP
    ... def test_all_reduce(tmp_path):
    ...     ...
    """

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run_distributed(wrapper, world_size, *args, backend=backend, timeout=timeout, **kwargs)

        setattr(wrapper, _INNER_ATTR, fn)
        return wrapper  # type: ignore[return-value]

    return decorate


_HOST_READS = ("item", "__bool__", "__float__", "__int__", "tolist")


@contextlib.contextmanager
def count_host_reads(counter: list[int]) -> Iterator[list[int]]:
    """Within the block, add 1 to ``counter[0]`` for every Python-level host read of a tensor
    (``item``, ``bool``, ``float``, ``int``, ``tolist``: each a device->host sync on a GPU),
    so a CPU test can assert that code runs without one.

    >>> reads = [0]
    >>> with count_host_reads(reads):
    ...     _ = torch.ones(()).item()
    >>> reads
    [1]
    """
    import torch

    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counted(name: str) -> Callable[..., Any]:
        original = originals[name]

        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            counter[0] += 1
            return original(self, *args, **kwargs)

        return read

    for name in _HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
