"""Repository-wide test fixtures: tests of the benchmark scripts under tools/bench."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent / "tools" / "bench"


@pytest.fixture
def bench_script() -> Callable[[str], ModuleType]:
    """Loads ``tools/bench/<name>.py`` as the module ``<name>`` (registered in ``sys.modules``,
    which the scripts' dataclasses and sibling imports look up)."""

    def load(name: str) -> ModuleType:
        script = BENCH / f"{name}.py"
        assert script.exists(), (
            f"{script} is missing: the bench this test checks moved or was removed"
        )
        spec = importlib.util.spec_from_file_location(name, script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    return load
