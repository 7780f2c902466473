"""The fused dequantize-GEMV Triton kernel, run by Triton's CPU interpreter, against the reference.

The interpreter must be on before Triton is first imported, so the check runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = """
import torch
from torch import nn
from slipstream.inference import quant_matmul
from slipstream.inference.quantize import WeightOnlyLinear

torch.manual_seed(0)
x = torch.randn(2, 1, 128)
assert quant_matmul.gemv_supported(x, 32)
assert not quant_matmul.gemv_supported(torch.randn(16, 128), 32)  # a prefill: dequantize + matmul
for bits in (8, 4):
    layer = WeightOnlyLinear(nn.Linear(128, 80), bits, group_size=32)  # 80 rows: a partial block
    expected = x @ layer.dequantized_weight().t() + layer.bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_gemv_equals_dequantize_then_matmul() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
