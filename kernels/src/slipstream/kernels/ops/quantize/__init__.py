"""The ``quantize`` and ``dequantize`` ops: group-wise int8, packed int4 and fp8 (e4m3).

These are the building blocks of ZeRO++'s quantized communication (qwZ, qgZ), of weight
compression and of quantized inference: symmetric, one scale per group (fp32, or fp16 / bf16 rounded up: ``scale_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.ops.quantize.reference import (
    FORMATS,
    SCALE_DTYPES,
    check_format,
    check_scale_dtype,
)
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

QUANTIZE = "quantize"
DEQUANTIZE = "dequantize"

for _op in (QUANTIZE, DEQUANTIZE):
    register_op(
        _op,
        "reference",
        f"slipstream.kernels.ops.quantize.reference:{_op}",
        device_types=(ANY_DEVICE,),
        priority=0,
    )
    register_triton(_op, f"slipstream.kernels.ops.quantize.triton:{_op}")

__all__ = [
    "DEQUANTIZE",
    "FORMATS",
    "QUANTIZE",
    "SCALE_DTYPES",
    "QuantizedTensor",
    "dequantize",
    "quantize",
]


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor quantized group-wise by :func:`quantize`; :func:`dequantize` turns it back.

    Attributes:
        data: the codes, ``(groups, group_size)`` (int8 / float8_e4m3fn) or
            ``(groups, group_size // 2)`` (uint8, two int4 codes per byte).
        scales: ``(groups,)``, fp32 (or fp16 / bf16: ``quantize``'s ``scale_dtype``); a value
            is ``code * scale`` (computed in fp32).
        format: ``"int8"``, ``"int4"`` or ``"fp8_e4m3"``.
        group_size: elements per group (the last group is zero-padded).
        shape: the original shape.
        dtype: the original dtype (what :func:`dequantize` returns).
    """

    data: torch.Tensor
    scales: torch.Tensor
    format: str
    group_size: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales (what a quantized all-gather would send)."""
        return self.data.numel() * self.data.element_size() + (
            self.scales.numel() * self.scales.element_size()
        )


def quantize(
    x: torch.Tensor,
    format: str = "int8",
    group_size: int = 128,
    scale_dtype: torch.dtype = torch.float32,
) -> QuantizedTensor:
    """Quantize ``x`` group-wise with the best available backend for its device and dtype.

    ``scale_dtype`` (fp32, fp16 or bf16): the dtype the scales are stored in. A 16-bit one
    rounds each fp32 scale up to the next representable value and computes the codes from the
    rounded scale (so no code clips; ValueError if a scale exceeds the dtype's range); that path
    runs the torch reference on ``x``'s device.

    >>> q = quantize(torch.randn(4, 100), "int4", group_size=64)
    >>> x_approx = dequantize(q)
    """
    check_format(format, group_size)
    check_scale_dtype(scale_dtype)
    if scale_dtype != torch.float32:
        from slipstream.kernels.ops.quantize.reference import quantize as reference_quantize

        data, scales = reference_quantize(x, format, group_size, scale_dtype)
        return QuantizedTensor(data, scales, format, group_size, x.shape, x.dtype)
    fn = get_op(QUANTIZE, x.device.type, x.dtype)
    data, scales = fn(x, format, group_size)
    return QuantizedTensor(data, scales, format, group_size, x.shape, x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values of ``q`` in its original shape, in ``dtype`` (default: the original dtype)."""
    out_dtype = q.dtype if dtype is None else dtype
    fn = get_op(DEQUANTIZE, q.data.device.type, out_dtype)
    numel = 1
    for size in q.shape:
        numel *= size
    flat = fn(q.data, q.scales, q.format, q.group_size, numel, out_dtype)
    return flat.reshape(q.shape)  # type: ignore[no-any-return]
