"""The decode GEMV ops: ``decode_gemv``, ``norm_gemv`` (add + RMSNorm first), ``gated_gemv`` (SwiGLU first)."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

__all__ = ["decode_gemv", "gated_gemv", "norm_gemv", "norm_gemv_rotary"]

_OPS = ("decode_gemv", "norm_gemv", "gated_gemv", "norm_gemv_rotary")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

for _name in _OPS:
    register_op(
        _name,
        "reference",
        f"slipstream.kernels.ops.decode_gemv.reference:{_name}",
        device_types=(ANY_DEVICE,),
        priority=0,
    )
    register_triton(_name, f"slipstream.kernels.ops.decode_gemv.triton:{_name}", _DTYPES)


def decode_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows (decode) with the best backend. ``pdl``:
    the GPU kernel launches with programmatic dependent launch (sm_90+; None: as its launch
    table says; no effect on the result).

    >>> y = decode_gemv(torch.randn(1, 8), torch.randn(4, 8))  # (1, 4)
    """
    fn = get_op("decode_gemv", x.device.type, x.dtype)
    return fn(x, weight, bias, pdl=pdl)  # type: ignore[no-any-return]


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, F.linear(rms_norm(x + residual, norm_weight, eps), weight, bias))``
    with the best backend (``residual`` None: ``x`` itself is normalised and returned;
    ``pdl`` as for :func:`decode_gemv`).

    >>> total, y = norm_gemv(torch.randn(1, 8), torch.randn(1, 8), torch.ones(8), 1e-6,
    ...                      torch.randn(4, 8))
    """
    fn = get_op("norm_gemv", x.device.type, x.dtype)
    return fn(x, residual, norm_weight, eps, weight, bias, pdl=pdl)  # type: ignore[no-any-return]


def norm_gemv_rotary(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_gemv` of a QKV projection and ``rotary_kv_write`` of its output in one
    kernel where it can run (one token per row, rotary over whole heads): ``(x + residual,
    q)`` with the rotated queries ``(batch, num_heads, 1, head_dim)``, the keys and values
    stored into ``key_cache`` / ``value_cache`` ``(batch, num_kv_heads, slots, head_dim)`` at
    ``slots``; ``cos``/``sin`` ``(batch, 1, head_dim / 2)``. ``pdl`` as for :func:`decode_gemv`.

    >>> keys, values = torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)
    >>> total, q = norm_gemv_rotary(torch.randn(1, 1, 16), None, torch.ones(16), 1e-6,
    ...     torch.randn((2 + 2) * 8, 16), None, torch.ones(1, 1, 4), torch.zeros(1, 1, 4),
    ...     keys, values, torch.tensor([0]), 2, 1)
    """
    fn = get_op("norm_gemv_rotary", x.device.type, x.dtype)
    return fn(  # type: ignore[no-any-return]
        x,
        residual,
        norm_weight,
        eps,
        weight,
        bias,
        cos,
        sin,
        key_cache,
        value_cache,
        slots,
        num_heads,
        num_kv_heads,
        pdl=pdl,
    )


def gated_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)`` for ``gate_up = [gate, up]`` (SwiGLU, then
    the down projection) with the best backend (``pdl`` as for :func:`decode_gemv`).

    >>> y = gated_gemv(torch.randn(1, 16), torch.randn(4, 8))  # (1, 4)
    """
    fn = get_op("gated_gemv", gate_up.device.type, gate_up.dtype)
    return fn(gate_up, weight, bias, pdl=pdl)  # type: ignore[no-any-return]
