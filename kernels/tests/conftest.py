"""Shared fixtures for slipstream-kernels tests (none autouse: other test modules live here too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from slipstream.kernels.accelerator import ACCELERATOR_ENV, set_accelerator

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
