"""The ``quant_matmul`` op: ``x @ W^T`` for a weight stored as group-wise int8 / int4 / fp8 codes.

The weight layout is :func:`slipstream.kernels.ops.quantize`'s applied to an ``(out, in)``
weight in groups along each row (see :func:`.reference.check_weight`), so a quantized weight
needs no repacking for the Triton kernel, which streams the codes and dequantizes in registers.
"""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.ops.quant_matmul.packing import is_packable, pack_gemv, unpack_gemv
from slipstream.kernels.ops.quant_matmul.reference import check_weight, dequantize_weight
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "quant_matmul"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.quant_matmul.reference:quant_matmul",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.quant_matmul.triton:quant_matmul")
PACKED_OP_NAME = "quant_matmul_packed"
register_op(
    PACKED_OP_NAME,
    "reference",
    "slipstream.kernels.ops.quant_matmul.reference:quant_matmul_packed",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(PACKED_OP_NAME, "slipstream.kernels.ops.quant_matmul.triton:quant_matmul_packed")

__all__ = [
    "OP_NAME",
    "PACKED_OP_NAME",
    "check_weight",
    "dequantize_weight",
    "is_packable",
    "pack_gemv",
    "quant_matmul",
    "quant_matmul_packed",
    "unpack_gemv",
]


def quant_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` with the best backend for ``x``'s device and dtype.

    ``codes``/``scales`` are ``quantize(W, format, group_size)``'s data and scales for an
    ``(out, in)`` weight ``W`` whose ``in`` is a multiple of ``group_size``; ``x`` is
    ``(..., in)``, the result ``(..., out)`` in ``x.dtype``.

    >>> from slipstream.kernels.ops import quantize
    >>> w = torch.randn(32, 64)
    >>> q = quantize(w, "int4", group_size=32)
    >>> y = quant_matmul(torch.randn(3, 64), q.data, q.scales, "int4", 32)
    """
    fn = get_op(OP_NAME, x.device.type, x.dtype)
    return fn(x, codes, scales, format, group_size, bias)  # type: ignore[no-any-return]


def quant_matmul_packed(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`quant_matmul` for an int8 / int4 weight repacked by :func:`pack_gemv` (int32
    words laid out for the decode GEMV kernel; ``scales`` unchanged). On GPUs a few rows run the
    CUDA-core GEMV kernel (``triton.quant_matmul_packed``), more rows unpack and take
    :func:`quant_matmul`'s path; elsewhere the reference (unpack, dequantize, matmul).
    """
    fn = get_op(PACKED_OP_NAME, x.device.type, x.dtype)
    return fn(x, words, scales, format, group_size, bias)  # type: ignore[no-any-return]
