"""tools/bench: the peak memory column adds the copy-engine publish's symmetric buffer, which
``torch.cuda.max_memory_allocated`` does not count, and labels it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parents[3] / "tools" / "bench"


def _load(name: str):
    script = BENCH / f"{name}.py"
    assert script.exists(), f"{script} is missing: the bench this test checks moved or was removed"
    spec = importlib.util.spec_from_file_location(name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_peak_column_adds_the_symmetric_buffer() -> None:
    run_all = _load("run_all")
    row = {"peak_alloc_gib": 30.1, "symmetric_gib": 2.51, "peak_with_symmetric_gib": 32.61}
    assert run_all.peak_column(row) == "32.61 = 30.1 + 2.51 symm"
    assert run_all.peak_column({**row, "symmetric_gib": 0.0}) == "30.1"
    assert run_all.peak_column({"peak_alloc_gib": 30.1}) == "30.1"  # rows from older runs


def test_train_bench_reads_the_buffer_from_the_gradient_paths_memory_report() -> None:
    bench = _load("train_bench")
    report = {"masters_cuda": 5 * 2**30, "publish_buffer_cuda": 5 * 2**29}
    engine = SimpleNamespace(gradient_path=SimpleNamespace(memory_report=lambda: report))
    assert bench._outside_allocator_gib(engine) == 2.5
    assert bench._outside_allocator_gib(SimpleNamespace()) == 0.0  # FSDP2, DDP, DeepSpeed
    del report["publish_buffer_cuda"]  # the all-gathers: nothing outside the allocator
    assert bench._outside_allocator_gib(engine) == 0.0
