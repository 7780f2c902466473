"""Shared fixtures for slipstream-kernels tests (none autouse: other test modules live here too)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from slipstream.kernels.accelerator import ACCELERATOR_ENV, set_accelerator

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The switch is read when a
# @triton.jit function is defined, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    """Register this package's extra marker (the root config lists the shared ones)."""
    config.addinivalue_line(
        "markers", "aot: compiles Triton kernels for GPU targets ahead of time (nox -s kernels)"
    )


_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
    ],
)


@pytest.fixture(params=["cpu", _CUDA])
def kernel_device(request: pytest.FixtureRequest) -> torch.device:
    """Each test that takes it runs on CPU, and again on the GPU when run with ``-m gpu``."""
    return torch.device(request.param)


@pytest.fixture
def fresh_accelerator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget the cached accelerator and the env override before and after the test."""
    monkeypatch.delenv(ACCELERATOR_ENV, raising=False)
    set_accelerator(None)
    yield
    set_accelerator(None)


@pytest.fixture(scope="module")
def cpu_optim():
    """The built CPU optimizer extension (built into the cache on first use, ~1-3 minutes);
    skipped only where no C++ compiler exists (CI has one, so there it always runs)."""
    from slipstream.kernels.build_ops import compiler_path

    if compiler_path() is None:
        pytest.skip("no C++ compiler to build the CPU optimizers")
    from slipstream.kernels.ops import cpu_optim

    return cpu_optim


@pytest.fixture(params=["cpu", _CUDA])
def triton_device(request: pytest.FixtureRequest) -> torch.device:
    """Triton kernel tests: the CPU under TRITON_INTERPRET=1, and the GPU under ``-m gpu``."""
    pytest.importorskip("triton", reason="the Triton backends need `pip install triton`")
    if request.param == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels run on the CPU only under TRITON_INTERPRET=1")
        _skip_broken_interpreter()
    return torch.device(request.param)


def _skip_broken_interpreter() -> None:
    import numpy

    from slipstream.kernels.triton_support import triton_version

    version = triton_version() or (0,)
    numpy_version = tuple(int(part) for part in numpy.__version__.split(".")[:2])
    # Triton < 3.9's interpreter calls int() on one-element arrays, which NumPy 2.4 rejects.
    if version < (3, 9) and numpy_version >= (2, 4):
        pytest.skip(
            f"the interpreter of triton {'.'.join(map(str, version))} fails with NumPy "
            f"{numpy.__version__}; install triton>=3.9 to run Triton kernels on the CPU"
        )
