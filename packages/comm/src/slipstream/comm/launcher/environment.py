"""Environment handed to workers: ``.slipstream_env`` files, passed-through variables, OpenMP."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "ENV_FILE_NAME",
    "PASSTHROUGH_PREFIXES",
    "collect_exports",
    "cpu_cores",
    "default_omp_threads",
    "parse_env_file",
]

logger = logging.getLogger(__name__)

ENV_FILE_NAME = os.environ.get("SLIPSTREAM_ENV_FILE", ".slipstream_env")
# Variables forwarded to every node whatever their value: NCCL/RCCL tuning, Python's own
# (PYTHONPATH, ...), UCX transport settings. NVLS switches are matched by substring below.
PASSTHROUGH_PREFIXES = ("NCCL_", "RCCL_", "PYTHON", "UCX_")


def parse_env_file(path: Path) -> dict[str, str]:
    """Read ``KEY=VALUE`` lines (``#`` comments, blank lines and ``export KEY=VALUE`` allowed).

    Values keep everything after the first ``=``; one pair of surrounding quotes is removed.

    Raises:
        ValueError: on a line that is not ``KEY=VALUE`` (the message names file and line).
    """
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].strip()
        key, equals, value = line.partition("=")
        key = key.strip()
        if not equals or not key.isidentifier():
            raise ValueError(f"{path}:{number}: {raw.strip()!r} is not KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def collect_exports(
    environ: Mapping[str, str], search_dirs: list[Path] | None = None
) -> dict[str, str]:
    """Variables to set on every worker of every node.

    From `environ`: every ``NCCL_*``, ``RCCL_*``, ``PYTHON*``, ``UCX_*`` and any variable
    whose name contains ``NVLS``. Then each ``.slipstream_env`` found in `search_dirs`
    (default: the home directory, then the working directory; later files win).
    """
    exports = {
        key: value
        for key, value in environ.items()
        if key.startswith(PASSTHROUGH_PREFIXES) or "NVLS" in key
    }
    if search_dirs is None:
        search_dirs = [Path.home(), Path.cwd()]
    seen: set[Path] = set()
    for directory in search_dirs:
        env_file = (directory / ENV_FILE_NAME).resolve()
        if env_file in seen or not env_file.is_file():
            continue
        seen.add(env_file)
        logger.info("passing the variables of %s to every worker", env_file)
        exports.update(parse_env_file(env_file))
    return exports


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


# Set beside OMP_NUM_THREADS when the launcher (not the user) chose it, holding the value it
# chose: code that sizes its own thread pools (CPU offload) then treats it as a launcher default.
OMP_DEFAULTED_ENV = "SLIPSTREAM_OMP_NUM_THREADS_DEFAULTED"


def default_omp_threads(
    procs_per_node: int, environ: Mapping[str, str], cores: int | None = None
) -> int | None:
    """``OMP_NUM_THREADS`` to give workers: ``cores // procs_per_node`` (at least 1).

    Returns None when the user set ``OMP_NUM_THREADS`` already (theirs is kept). Splitting the
    cores evenly stops N processes each starting one OpenMP thread per core, which
    oversubscribes the machine N times over.
    """
    if environ.get("OMP_NUM_THREADS"):
        return None
    if cores is None:
        cores = cpu_cores()
    return max(1, cores // max(1, procs_per_node))
