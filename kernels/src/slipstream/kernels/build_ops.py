"""Build (and find) Slipstream's C++ extensions: ``python -m slipstream.kernels.build_ops``.

[Note: when C++ ops are compiled]
Compiling the CPU optimizer extension takes about a minute (torch's headers dominate), so it
never happens silently inside a training step:

- ``python -m slipstream.kernels.build_ops`` (``slipstream build-ops``) builds every C++ op into
  the cache ahead of time: run it once per environment (image build, first setup).
- Otherwise the first *query* of a ``cpp`` backend builds it into the same cache (logged as a
  warning naming the prebuild command), and every later process loads the cached ``.so``.
  Set ``SLIPSTREAM_BUILD_OPS_ON_DEMAND=0`` to forbid that: an unbuilt op is then unavailable
  and the registry falls back to the reference with one warning.
- No C++ compiler: the backend is unavailable with that reason; training goes on with the
  reference.

The cache is ``$SLIPSTREAM_OPS_CACHE`` or ``~/.cache/slipstream/ops``, with one subfolder per
(torch version, Python version, source hash), so a torch upgrade or a source change builds a
fresh copy instead of loading a stale ABI.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "SLIPSTREAM_OPS_CACHE"
ON_DEMAND_ENV = "SLIPSTREAM_BUILD_OPS_ON_DEMAND"
_OPS = Path(__file__).parent / "ops"


@dataclass(frozen=True)
class Extension:
    """One C++/CUDA extension: its sources and flags (see the note at the top of this module)."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    gpu: bool = False  # needs a CUDA or ROCm build of torch and nvcc/hipcc


CPU_OPTIM = Extension(
    name="slipstream_cpu_optim",
    sources=(_OPS / "cpu_optim" / "cpu_optim.cpp",),
    # -fno-math-errno lets sqrt vectorise; -O3 turns on the loop vectoriser for each ISA wrapper.
    cflags=("-O3", "-fopenmp", "-fno-math-errno", "-std=c++17"),
    ldflags=("-fopenmp",),
)
FUSED_ADAM_CUDA = Extension(
    name="slipstream_fused_adam_cuda",
    sources=(
        _OPS / "adam" / "csrc" / "fused_adam_binding.cpp",
        _OPS / "adam" / "csrc" / "fused_adam.cu",
    ),
    cflags=("-O3", "-std=c++17"),
    cuda_cflags=("-O3",),
    gpu=True,
)
EXTENSIONS = (CPU_OPTIM, FUSED_ADAM_CUDA)
CPU_OPTIM_NAME = CPU_OPTIM.name

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}


def cache_root() -> Path:
    """The folder that holds every built extension (see the module docstring)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "slipstream" / "ops"


def _build_dir(extension: Extension) -> Path:
    digest = hashlib.sha256()
    for source in extension.sources:
        digest.update(source.read_bytes())
    header = extension.sources[0].parent
    for extra in sorted(header.glob("*.h")):
        digest.update(extra.read_bytes())
    digest.update(" ".join(extension.cflags + extension.ldflags + extension.cuda_cflags).encode())
    version = torch.__version__.replace("+", "_")
    tag = f"torch{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    return cache_root() / extension.name / f"{tag}-{digest.hexdigest()[:12]}"


def _built_library(build_dir: Path, name: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = build_dir / f"{name}{suffix}"
        if candidate.exists():
            return candidate
    candidate = build_dir / f"{name}.so"
    return candidate if candidate.exists() else None


def compiler_path() -> str | None:
    """The C++ compiler torch's build tools would use (``$CXX`` or ``c++``), if it exists."""
    return shutil.which(os.environ.get("CXX", "c++"))


def gpu_compiler() -> tuple[str | None, str]:
    """``(path, name)`` of the GPU compiler this torch build needs: nvcc (CUDA) or hipcc (ROCm)."""
    if torch.version.hip is not None:
        return shutil.which("hipcc"), "hipcc"
    return shutil.which("nvcc"), "nvcc"


def _toolchain_problem(extension: Extension) -> str:
    if compiler_path() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH; install g++ or set CXX"
    if extension.gpu:
        if torch.version.cuda is None and torch.version.hip is None:
            return "this torch build has neither CUDA nor ROCm support"
        path, name = gpu_compiler()
        if path is None:
            return f"no {name} on PATH to build {extension.name}"
    return ""


def on_demand_allowed() -> bool:
    """Whether a missing extension may be built on first use (``SLIPSTREAM_BUILD_OPS_ON_DEMAND``)."""
    return os.environ.get(ON_DEMAND_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _import_library(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the extension at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_extension(
    extension: Extension, *, build: bool | None = None, verbose: bool = False
) -> ModuleType:
    """The compiled ``extension``: from the cache, or built now.

    ``build=None`` builds when on-demand builds are allowed; ``False`` only loads a cached
    build (ImportError if there is none); ``True`` always allows building.
    """
    with _lock:
        if extension.name in _loaded:
            return _loaded[extension.name]
        build_dir = _build_dir(extension)
        library = _built_library(build_dir, extension.name)
        if library is not None:
            module = _import_library(library, extension.name)
        else:
            allowed = on_demand_allowed() if build is None else build
            if not allowed:
                raise ImportError(
                    f"{extension.name} is not built in {build_dir} and {ON_DEMAND_ENV}=0 forbids "
                    "building it now; run `python -m slipstream.kernels.build_ops` (or "
                    "`slipstream build-ops`)"
                )
            problem = _toolchain_problem(extension)
            if problem:
                raise ImportError(
                    f"cannot build {extension.name}: {problem}; then run "
                    "`python -m slipstream.kernels.build_ops`"
                )
            if build is None:
                logger.warning(
                    "building the C++ extension %s into %s (1-3 minutes, once per environment); "
                    "prebuild it with `python -m slipstream.kernels.build_ops`",
                    extension.name,
                    build_dir,
                )
            module = _build(extension, build_dir, verbose)
        _loaded[extension.name] = module
        return module


def load_cpu_optimizer(*, build: bool | None = None, verbose: bool = False) -> ModuleType:
    """The compiled CPU optimizer extension (see :func:`load_extension`)."""
    return load_extension(CPU_OPTIM, build=build, verbose=verbose)


def _build(extension: Extension, build_dir: Path, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # On a ROCm build of torch, cpp_extension hipifies the .cu sources and compiles with hipcc.
    module = cpp_extension.load(
        name=extension.name,
        sources=[str(source) for source in extension.sources],
        extra_cflags=list(extension.cflags),
        extra_cuda_cflags=list(extension.cuda_cflags) if extension.gpu else None,
        extra_ldflags=list(extension.ldflags),
        extra_include_paths=[str(extension.sources[0].parent)],
        build_directory=str(build_dir),
        verbose=verbose,
    )
    logger.info("built %s in %.0f s", extension.name, time.perf_counter() - start)
    return module


def extension_probe(extension: Extension) -> tuple[bool, str]:
    """The registry probe of a compiled backend: built (or buildable now), or why not."""
    build_dir = _build_dir(extension)
    if extension.name in _loaded or _built_library(build_dir, extension.name) is not None:
        return True, ""
    if not on_demand_allowed():
        return False, f"not built ({ON_DEMAND_ENV}=0); run `python -m slipstream.kernels.build_ops`"
    problem = _toolchain_problem(extension)
    if problem:
        return False, problem
    return (
        True,
        "not built yet: builds on first use; prebuild: python -m slipstream.kernels.build_ops",
    )


def cpu_optimizer_probe() -> tuple[bool, str]:
    """The registry probe of the ``cpp`` CPU optimizer backends."""
    return extension_probe(CPU_OPTIM)


def fused_adam_cuda_probe() -> tuple[bool, str]:
    """The registry probe of the ``cuda`` backend of ``adam`` (CUDA C++, hipified on ROCm)."""
    if not torch.cuda.is_available():
        return False, "no CUDA/ROCm device"
    return extension_probe(FUSED_ADAM_CUDA)


def extension_status(extension: Extension) -> str:
    """``"built at <path>"`` or ``"not built (<dir>)"`` for one extension (any package's)."""
    build_dir = _build_dir(extension)
    library = _built_library(build_dir, extension.name)
    return f"built at {library}" if library else f"not built ({build_dir})"


def build_status() -> dict[str, str]:
    """``{extension: "built at <path>" | "not built (<dir>)"}`` for every extension."""
    return {extension.name: extension_status(extension) for extension in EXTENSIONS}


def main(argv: Sequence[str] | None = None) -> int:
    """Prebuild every C++ op into the cache; print where each went (exit 1 on failure)."""
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.kernels.build_ops",
        description="Build Slipstream's C++ ops into the extension cache.",
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    print(f"cache: {cache_root()}")
    failed = False
    for extension in EXTENSIONS:
        problem = _toolchain_problem(extension)
        if extension.gpu and problem:
            print(f"{extension.name}: skipped ({problem})")
            continue
        try:
            module = load_extension(extension, build=True, verbose=args.verbose)
        except Exception as exc:  # report the build failure and say what to do
            print(f"{extension.name}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed = True
            continue
        note = ""
        if extension is CPU_OPTIM:
            note = f" (ISAs here: {', '.join(module.supported_isas())})"
        print(f"{extension.name}: {build_status()[extension.name]}{note}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
