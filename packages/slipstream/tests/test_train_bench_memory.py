"""tools/bench: the peak memory column adds the copy-engine publish's symmetric buffer, which
``torch.cuda.max_memory_allocated`` does not count, and labels it."""

from __future__ import annotations

from types import SimpleNamespace


def test_the_peak_column_adds_the_symmetric_buffer(bench_script) -> None:
    run_all = bench_script("run_all")
    row = {"peak_alloc_gib": 30.1, "symmetric_gib": 2.51, "peak_with_symmetric_gib": 32.61}
    assert run_all.peak_column(row) == "32.61 = 30.1 + 2.51 symm"
    assert run_all.peak_column({**row, "symmetric_gib": 0.0}) == "30.1"
    assert run_all.peak_column({"peak_alloc_gib": 30.1}) == "30.1"  # rows from older runs


def test_train_bench_reads_the_buffer_from_the_gradient_paths_memory_report(bench_script) -> None:
    bench = bench_script("train_bench")
    report = {"masters_cuda": 5 * 2**30, "publish_buffer_cuda": 5 * 2**29}
    engine = SimpleNamespace(gradient_path=SimpleNamespace(memory_report=lambda: report))
    assert bench._outside_allocator_gib(engine) == 2.5
    assert bench._outside_allocator_gib(SimpleNamespace()) == 0.0  # FSDP2, DDP, DeepSpeed
    del report["publish_buffer_cuda"]  # the all-gathers: nothing outside the allocator
    assert bench._outside_allocator_gib(engine) == 0.0
