"""The C++ CPU optimizers' thread count holds for steps called from any Python thread.

CPU offload steps on a worker thread (``overlap_step``); OpenMP's own ``omp_set_num_threads``
holds only for the thread that calls it, so a worker under torchrun (``OMP_NUM_THREADS=1``)
used to step single-threaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import threading
    import torch
    from slipstream.kernels.ops import cpu_optim

    seen = {}
    cpu_optim.set_num_threads(3)
    seen["main"] = cpu_optim.max_threads()

    def work():
        seen["worker"] = cpu_optim.max_threads()
        p = torch.zeros(1 << 16)
        cpu_optim.adam([p], [torch.ones_like(p)], [torch.zeros_like(p)], [torch.zeros_like(p)],
                       lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                       adam_w_mode=True, bias_correction=True, step=1)
        seen["stepped"] = bool((p < 0).all())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    print(seen["main"], seen["worker"], seen["stepped"])
    """
)


@pytest.fixture(scope="module")
def cpu_optim():
    from slipstream.kernels import build_ops

    ok, reason = build_ops.cpu_optimizer_probe()
    if not ok:
        pytest.skip(f"C++ CPU optimizers not buildable here: {reason}")
    from slipstream.kernels.ops import cpu_optim

    return cpu_optim


def test_thread_count_applies_to_steps_from_other_threads(cpu_optim) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun's default for its workers
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3", "3", "True"]


def _run_all_kernels(cpu_optim, seed: int, schedule: str = "static") -> list:
    """Adam (in place and out of place, bf16 grads and copies), Adagrad and Lion on tensors
    of several chunks each (a chunk is 16 Ki elements) plus odd small ones."""
    import torch

    sizes = [(1 << 16) + 5, 3, 40_000, 1 << 14]
    gen = torch.Generator().manual_seed(seed)

    def fresh(dtype=torch.float32):
        return [torch.randn(n, generator=gen).to(dtype) for n in sizes]

    params, grads, m = fresh(), fresh(torch.bfloat16), fresh()
    v = [t.abs() for t in fresh()]  # second moments are not negative
    copies = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    adam = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, adam_w_mode=True,
                bias_correction=True, step=3, schedule=schedule)  # fmt: skip
    outs = tuple([torch.empty(n) for n in sizes] for _ in range(3))
    cpu_optim.adam(params, grads, m, v, param_copies=copies, out=outs, **adam)
    results = [t.clone() for group in outs for t in group] + [c.clone() for c in copies]
    cpu_optim.adam(params, grads, m, v, param_copies=copies, **adam)
    results += [t.clone() for t in params + m + v + copies]
    cpu_optim.adagrad(
        params, grads, v, lr=0.05, eps=1e-10, weight_decay=0.1, param_copies=copies,
        schedule=schedule,
    )  # fmt: skip
    results += [t.clone() for t in params + v + copies]
    cpu_optim.lion(
        params, grads, m, lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, schedule=schedule
    )
    return results + [t.clone() for t in params + m]


def test_dynamic_schedule_steps_bit_for_bit_like_static(cpu_optim, monkeypatch) -> None:
    import torch

    threads = cpu_optim.max_threads()
    cpu_optim.set_num_threads(3)  # more threads than this machine's cores: chunks interleave
    try:
        for isa in cpu_optim.supported_isas():
            monkeypatch.setenv("SLIPSTREAM_CPU_ISA", isa)
            runs = {}
            for schedule in ("static", "dynamic"):
                runs[schedule] = _run_all_kernels(cpu_optim, seed=5, schedule=schedule)
            assert len(runs["static"]) == len(runs["dynamic"])
            for a, b in zip(runs["static"], runs["dynamic"]):
                assert torch.equal(a, b), isa
    finally:
        cpu_optim.set_num_threads(threads)


def test_schedule_errors_name_the_setting(cpu_optim) -> None:
    import torch

    p = torch.zeros(8)
    args = ([p], [torch.ones_like(p)], [torch.zeros_like(p)])
    with pytest.raises(ValueError, match="schedule='guided' is not one of"):
        cpu_optim.lion(*args, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, schedule="guided")
    # The C++ side checks the value it is given too.
    ext = cpu_optim._extension()
    with pytest.raises(RuntimeError, match="schedule must be 'static' or 'dynamic'"):
        ext.lion_step(*args, [], 0.1, 0.9, 0.99, 0.0, 1.0, "auto", "guided")


def test_last_step_stats_time_the_calling_threads_last_adam(cpu_optim) -> None:
    # Benchmarks read the C++ step's own clock (CPU offload's cpu_kernel_ms): per calling thread,
    # the last Adam's region and each OpenMP thread's share, ends not before starts.
    import threading

    import torch

    seen: dict[str, object] = {}

    def work() -> None:
        seen["before"] = cpu_optim.last_step_stats()
        p = torch.zeros(1 << 16)
        cpu_optim.adam([p], [torch.ones_like(p)], [torch.zeros_like(p)], [torch.zeros_like(p)],
                       lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                       adam_w_mode=True, bias_correction=True, step=1)  # fmt: skip
        seen["after"] = cpu_optim.last_step_stats()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["before"] is None  # a fresh thread has not stepped
    stats = seen["after"]
    assert isinstance(stats, dict) and stats["threads"] >= 1
    assert 0 <= stats["start_mean_s"] <= stats["start_max_s"] <= stats["wall_s"]
    assert stats["start_mean_s"] <= stats["end_mean_s"] <= stats["end_max_s"] <= stats["wall_s"]
