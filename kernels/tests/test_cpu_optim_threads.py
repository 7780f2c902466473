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
