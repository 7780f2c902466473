"""Pure-torch weight-only quantized matmul: dequantize the whole weight, then ``F.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.kernels.ops.quantize.reference import FORMATS, SCALE_DTYPES, dequantize

__all__ = [
    "check_weight",
    "dequantize_weight",
    "quant_decode_gemv",
    "quant_decode_qkv",
    "quant_matmul",
    "quant_matmul_packed",
]


def check_weight(
    codes: torch.Tensor, scales: torch.Tensor, format: str, group_size: int, in_features: int
) -> int:
    """Validate a quantized weight's layout; returns ``out_features``.

    The layout is :func:`slipstream.kernels.ops.quantize`'s applied to an ``(out, in)`` weight
    whose rows are a whole number of groups: ``codes`` is ``(out, in)`` (int8, float8_e4m3fn) or
    ``(out, in // 2)`` (uint8, int4 pairs), ``scales`` fp32, fp16 or bf16 (``quantize``'s
    ``scale_dtype``; the kernels multiply in fp32) with ``out * in // group_size`` elements
    (row-major ``(out, in // group_size)``).
    """
    if format not in FORMATS:
        raise ValueError(f"quant_matmul: format must be one of {FORMATS}, got {format!r}")
    if scales.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"quant_matmul: scales must be one of {SCALE_DTYPES}, got {scales.dtype}; "
            "quantize with scale_dtype"
        )
    if group_size < 1 or in_features % group_size:
        raise ValueError(
            f"quant_matmul: in_features {in_features} is not a multiple of group_size "
            f"{group_size}; quantize with a group size that divides the rows"
        )
    per_row = in_features // 2 if format == "int4" else in_features
    if codes.numel() % per_row:
        raise ValueError(
            f"quant_matmul: {codes.numel()} codes do not form rows of {per_row} "
            f"({format}, in_features={in_features})"
        )
    out_features = codes.numel() // per_row
    if scales.numel() != out_features * (in_features // group_size):
        raise ValueError(
            f"quant_matmul: expected {out_features * (in_features // group_size)} scales for "
            f"({out_features}, {in_features}) in groups of {group_size}, got {scales.numel()}"
        )
    return out_features


def dequantize_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``(out, in)`` weight the codes stand for, in ``dtype`` (fp32 math, then cast)."""
    out_features = check_weight(codes, scales, format, group_size, in_features)
    groups = codes.reshape(-1, group_size // 2 if format == "int4" else group_size)
    flat = dequantize(
        groups, scales.reshape(-1), format, group_size, out_features * in_features, dtype
    )
    return flat.reshape(out_features, in_features)


def quant_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` for the quantized ``W``: dequantize into ``x.dtype``, then multiply."""
    weight = dequantize_weight(codes, scales, format, group_size, x.shape[-1], x.dtype)
    return F.linear(x, weight, bias)


def quant_matmul_packed(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`quant_matmul` for a weight in :func:`.packing.pack_gemv`'s layout."""
    from slipstream.kernels.ops.quant_matmul.packing import unpack_gemv

    codes = unpack_gemv(words, format, x.shape[-1])
    return quant_matmul(x, codes, scales, format, group_size, bias)


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
    pdl: str = "on",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A packed-weight decode GEMV with a decoder block's small ops around it (fp32 math, the
    unfused ops' roundings); returns ``(out, total, stats_out)``. (``pdl``: the GPU kernel's
    launch option, nothing here.)

    ``y = (W @ x) * rstd + bias`` rounded to ``x.dtype``, where ``rstd = 1 / sqrt(sum(stats) /
    in_features + eps)`` per row when ``stats`` (partial sums of squares of the row ``x`` is the
    RMSNorm input of, any number per row) is given, else 1; then

    - ``gated``: ``out = silu(gate) * up`` for ``y = [gate, up]`` (``gated_activation``'s
      roundings);
    - ``residual`` (with ``norm_weight``): ``total = residual + y`` (rounded), ``out = total *
      norm_weight`` (rounded; the next RMSNorm but its ``rstd``) and ``stats_out`` the partial
      sums of ``total**2`` for the next call's ``stats`` (one per row here);
    - else ``out = y``.
    """
    from slipstream.kernels.ops.quant_matmul.packing import unpack_gemv

    in_features = x.shape[-1]
    codes = unpack_gemv(words, format, in_features)
    weight = dequantize_weight(codes, scales, format, group_size, in_features, torch.float32)
    y = F.linear(x.float(), weight)
    if stats is not None:
        sums = stats.float().reshape(*x.shape[:-1], -1).sum(-1, keepdim=True)
        y = y * torch.rsqrt(sums / in_features + eps)
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if gated:
        gate, up = y.float().chunk(2, dim=-1)
        act = F.silu(gate).to(x.dtype).float()
        return (act * up).to(x.dtype), None, None
    if residual is None:
        return y, None, None
    if norm_weight is None:
        raise ValueError("quant_decode_gemv: residual needs norm_weight")
    total = (y.float() + residual.float()).to(residual.dtype)
    stats_out = total.float().pow(2).sum(-1).reshape(-1, 1)
    return (total.float() * norm_weight.float()).to(x.dtype), total, stats_out


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
    pdl: str = "on",
) -> torch.Tensor:
    """:func:`quant_decode_gemv` of a fused QKV projection (``x`` ``(batch, 1, in)``, with the
    norm's ``stats``), then ``rotary_kv_write``: returns the rotated queries ``(batch,
    num_heads, 1, head_dim)`` and writes the rotated keys and the values into the caches at
    ``slots``. (``pdl``: the GPU kernel's launch option, nothing here.)"""
    from slipstream.kernels.ops.rotary_kv_write.reference import rotary_kv_write

    y = quant_decode_gemv(x, words, scales, format, group_size, bias, stats, eps)[0]
    return rotary_kv_write(
        y.reshape(x.shape[0], -1, y.shape[-1]),
        cos,
        sin,
        key_cache,
        value_cache,
        slots,
        num_heads,
        num_kv_heads,
    )
