"""The Triton and C++ backends in the registry: registered per op, optional, falling back cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slipstream.kernels.registry import list_ops
from slipstream.kernels.triton_support import triton_probe

TRITON_OPS = {
    "adam",
    "add_rms_norm",
    "argmax",
    "cross_entropy",
    "decode_attention",
    "decode_gemv",
    "decode_inputs",
    "dequantize",
    "gated_activation",
    "gated_gemv",
    "lamb",
    "layer_norm",
    "lion",
    "moe_gemv",
    "norm_gemv",
    "norm_gemv_rotary",
    "paged_attention",
    "quant_decode_gemv",
    "quant_decode_qkv",
    "quant_matmul",
    "quant_matmul_packed",
    "quantize",
    "rms_norm",
    "rotary_embedding",
    "rotary_kv_write",
    "softmax",
}
SRC = Path(__file__).resolve().parents[1] / "src"


def test_every_triton_op_is_registered_for_gpus() -> None:
    rows = [row for row in list_ops("cuda") if row.backend == "triton"]
    assert {row.op for row in rows} == TRITON_OPS
    for row in rows:
        assert row.device_types == ("cuda",) and row.priority == 10
        assert row.available == triton_probe()[0]


def test_cpp_backends_are_cpu_only_fp32() -> None:
    rows = [row for row in list_ops("cpu") if row.backend == "cpp"]
    assert {row.op for row in rows} == {"adam", "adagrad", "lion"}
    assert all(row.device_types == ("cpu",) and row.dtypes == ("float32",) for row in rows)


def test_without_triton_the_package_imports_and_falls_back() -> None:
    # A fresh interpreter in which `import triton` fails, as on a machine without it.
    code = (
        "import sys, logging, torch\n"
        "sys.modules['triton'] = None\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "import slipstream.kernels\n"
        "from slipstream.kernels.registry import default_registry, list_ops\n"
        "row = next(r for r in list_ops('cuda') if r.op == 'rms_norm' and r.backend == 'triton')\n"
        "print('available', row.available, row.reason)\n"
        "print('chosen', default_registry().select('rms_norm', 'cuda', torch.bfloat16)[0])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    completed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert "available False triton is not installed" in completed.stdout
    assert "chosen reference" in completed.stdout
    assert "backend 'triton' is unavailable on cuda" in completed.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_gpu_dispatch_picks_triton() -> None:
    pytest.importorskip("triton")
    from slipstream.kernels.ops import rms_norm
    from slipstream.kernels.registry import default_registry

    assert default_registry().select("rms_norm", "cuda", torch.bfloat16)[0] == "triton"
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    assert rms_norm(x).shape == x.shape
