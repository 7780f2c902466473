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
DECODE_OP_NAME = "quant_decode_gemv"
register_op(
    DECODE_OP_NAME,
    "reference",
    "slipstream.kernels.ops.quant_matmul.reference:quant_decode_gemv",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(
    DECODE_OP_NAME,
    "slipstream.kernels.ops.quant_matmul.fused_gemv:fused_quant_gemv",
    (torch.float16, torch.bfloat16, torch.float32),
)
QKV_OP_NAME = "quant_decode_qkv"
register_op(
    QKV_OP_NAME,
    "reference",
    "slipstream.kernels.ops.quant_matmul.reference:quant_decode_qkv",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(
    QKV_OP_NAME,
    "slipstream.kernels.ops.quant_matmul.fused_gemv:fused_quant_qkv",
    (torch.float16, torch.bfloat16, torch.float32),
)

__all__ = [
    "DECODE_OP_NAME",
    "OP_NAME",
    "PACKED_OP_NAME",
    "QKV_OP_NAME",
    "check_weight",
    "dequantize_weight",
    "is_packable",
    "pack_gemv",
    "quant_decode_gemv",
    "quant_decode_qkv",
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


def quant_decode_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    *,
    pdl: str = "on",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`quant_matmul_packed` for a few rows (decode) with a decoder block's small ops
    folded in, with the best backend: the RMSNorm's ``1 / rms`` from ``stats`` applied to the
    output, SiLU * up after a ``[gate; up]`` weight (``gated``), or the residual add and the
    next RMSNorm's weight after it (``residual``, ``norm_weight``: also returns the residual
    sum and the partial sums of squares for the next call's ``stats``). Returns ``(out, total,
    stats_out)``; see :func:`.reference.quant_decode_gemv` for the exact math and
    :mod:`.fused_gemv` for the kernel. ``pdl``: the GPU kernel's programmatic dependent
    launch (``"on"``, ``"l2_partial"``, ``"off"``; :data:`.fused_gemv.PDL_MODES`).

    >>> from slipstream.kernels.ops import quantize
    >>> q = quantize(torch.randn(8, 128), "int4", group_size=128)
    >>> words = pack_gemv(q.data.reshape(8, -1), "int4", 128, 128)
    >>> y, _, _ = quant_decode_gemv(torch.randn(1, 128), words, q.scales, "int4", 128)
    """
    fn = get_op(DECODE_OP_NAME, x.device.type, x.dtype)
    return fn(  # type: ignore[no-any-return]
        x, words, scales, format, group_size, bias, stats, eps, gated, residual, norm_weight,
        pdl=pdl,
    )  # fmt: skip


def quant_decode_qkv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None,
    stats: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    pdl: str = "on",
) -> torch.Tensor:
    """A decode step's fused QKV projection (:func:`quant_decode_gemv` with the norm's
    ``stats``) with ``rotary_kv_write`` folded into its epilogue: returns the rotated queries
    ``(batch, num_heads, 1, head_dim)`` and writes the rotated keys and the values into
    ``key_cache`` / ``value_cache`` ``(batch, kv_heads, slots, head_dim)`` at ``slots``, with
    the best backend (see :func:`.reference.quant_decode_qkv`); ``pdl`` as for
    :func:`quant_decode_gemv`."""
    fn = get_op(QKV_OP_NAME, x.device.type, x.dtype)
    return fn(  # type: ignore[no-any-return]
        x,
        words,
        scales,
        format,
        group_size,
        bias,
        stats,
        eps,
        cos,
        sin,
        key_cache,
        value_cache,
        slots,
        num_heads,
        num_kv_heads,
        pdl=pdl,
    )
