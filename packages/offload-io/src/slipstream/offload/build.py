"""Build (and find) the NVMe swap I/O extension: ``python -m slipstream.offload.build``.

The ``cpp`` backend of :class:`slipstream.offload.aio.AsyncIOEngine` is a small C++ extension
(``csrc/aio.cpp``) built with :mod:`slipstream.kernels.build_ops`, so it shares that module's
cache and rules (see its "when C++ ops are compiled" note): prebuilt by this command, else built
on first use unless ``SLIPSTREAM_BUILD_OPS_ON_DEMAND=0``, and keyed by torch version, Python
version and source hash. The extension includes only pybind11 (not all of torch's headers), so a
build takes seconds rather than a minute.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from slipstream.kernels.build_ops import (
    Extension,
    cache_root,
    extension_probe,
    extension_status,
    load_extension,
)

_CSRC = Path(__file__).parent / "csrc"

AIO = Extension(
    name="slipstream_offload_aio",
    sources=(_CSRC / "aio.cpp",),
    cflags=("-O2", "-std=c++17"),
    ldflags=("-lpthread",),
)


def load_aio(build: bool | None = None, *, verbose: bool = False) -> ModuleType:
    """The compiled aio extension (see :func:`slipstream.kernels.build_ops.load_extension`)."""
    return load_extension(AIO, build=build, verbose=verbose)


def aio_probe() -> tuple[bool, str]:
    """``(usable, why)``: whether the ``cpp`` aio backend is built or can be built now."""
    return extension_probe(AIO)


def aio_status() -> str:
    """``"built at <path>"`` or ``"not built (<dir>)"``."""
    return extension_status(AIO)


def main(argv: Sequence[str] | None = None) -> int:
    """Prebuild the aio extension into the cache; print where it went (exit 1 on failure)."""
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.offload.build",
        description="Build Slipstream's NVMe swap I/O extension into the extension cache.",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    print(f"cache: {cache_root()}")
    try:
        load_aio(build=True, verbose=args.verbose)
    except Exception as exc:  # report the build failure and say what to do
        print(f"{AIO.name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"{AIO.name}: {aio_status()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
