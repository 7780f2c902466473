"""Built-in ops; importing this registers every op's backends (one folder per op).

Each op folder holds ``reference.py`` (pure torch, backend ``"reference"``, priority 0) and an
``__init__.py`` that registers its backends and exposes a function dispatching through the
registry. Faster backends sit beside the reference in the same folder: ``triton.py`` (backend
``"triton"``, CUDA and ROCm GPUs) and, for the CPU optimizers, the C++ extension in
``cpu_optim/`` (backend ``"cpp"``).
"""

from __future__ import annotations

from slipstream.kernels.ops.adagrad import adagrad
from slipstream.kernels.ops.adam import adam
from slipstream.kernels.ops.add_rms_norm import add_rms_norm
from slipstream.kernels.ops.argmax import argmax
from slipstream.kernels.ops.cross_entropy import cross_entropy
from slipstream.kernels.ops.decode_attention import decode_attention
from slipstream.kernels.ops.decode_gemv import (
    decode_gemv,
    gated_gemv,
    norm_gemv,
    norm_gemv_rotary,
)
from slipstream.kernels.ops.decode_inputs import decode_inputs
from slipstream.kernels.ops.gated_activation import gated_activation
from slipstream.kernels.ops.lamb import lamb
from slipstream.kernels.ops.layer_norm import layer_norm
from slipstream.kernels.ops.lion import lion
from slipstream.kernels.ops.moe_gemv import moe_gemv
from slipstream.kernels.ops.paged_attention import paged_attention
from slipstream.kernels.ops.quant_matmul import quant_matmul
from slipstream.kernels.ops.quantize import QuantizedTensor, dequantize, quantize
from slipstream.kernels.ops.rms_norm import rms_norm
from slipstream.kernels.ops.rotary_embedding import rotary_cos_sin, rotary_embedding
from slipstream.kernels.ops.rotary_kv_write import rotary_kv_write
from slipstream.kernels.ops.softmax import causal_keep_mask, softmax

__all__ = [
    "QuantizedTensor",
    "adagrad",
    "adam",
    "add_rms_norm",
    "argmax",
    "causal_keep_mask",
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
    "quant_matmul",
    "quantize",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_embedding",
    "rotary_kv_write",
    "softmax",
]
