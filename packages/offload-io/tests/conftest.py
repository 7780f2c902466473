"""Fixtures shared by the offload-io tests: engines over both aio backends."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from slipstream.kernels.build_ops import compiler_path
from slipstream.offload.aio.config import AioSettings
from slipstream.offload.aio.engine import AsyncIOEngine

# "cpp" runs kernel AIO for O_DIRECT engines; "cpp-threads" the same extension's pread/pwrite
# pool (AioSettings.kernel_aio=False); "python" the ThreadPoolExecutor fallback.
VARIANTS = ("cpp", "cpp-threads", "python")


@pytest.fixture(scope="session")
def cpp_ready() -> bool:
    """Build (or load) the aio extension once; False only when there is no compiler."""
    if compiler_path() is None:
        return False
    from slipstream.offload.build import load_aio

    load_aio(build=True)  # a build failure with a compiler present is a test failure
    return True


@pytest.fixture(params=VARIANTS)
def backend_variant(request: pytest.FixtureRequest) -> str:
    """Each way of executing I/O in turn (cpp is skipped only where no C++ compiler exists)."""
    variant = str(request.param)
    if variant.startswith("cpp") and not request.getfixturevalue("cpp_ready"):
        pytest.skip("no C++ compiler on PATH: the cpp aio backend cannot be built")
    return variant


@pytest.fixture
def backend(backend_variant: str) -> str:
    """The ``backend=`` argument of the current variant: ``"cpp"`` or ``"python"``."""
    return "python" if backend_variant == "python" else "cpp"


@pytest.fixture
def make_engine(backend: str, backend_variant: str) -> Iterator[Callable[..., AsyncIOEngine]]:
    """``make_engine(**settings)``: an engine on the current variant, closed after the test."""
    engines: list[AsyncIOEngine] = []

    def make(**settings: object) -> AsyncIOEngine:
        settings.setdefault("kernel_aio", backend_variant != "cpp-threads")
        engine = AsyncIOEngine(AioSettings(**settings), backend=backend)  # type: ignore[arg-type]
        assert engine.backend_name == backend
        kernel = backend_variant == "cpp" and engine.settings.o_direct
        assert engine.io_mode == ("kernel-aio" if kernel else "threads")
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
