"""Fake quantization with a straight-through estimator: symmetric, asymmetric, ternary, binary.

Every function returns a tensor of the input's shape and dtype whose values lie exactly on the
quantized grid, and whose gradient with respect to the input is the identity (the straight-through
estimator; ``x + (q - x).detach()`` would be off the grid by rounding).

[Note: the symmetric grid] DeepSpeed's symmetric quantizer uses the codes
``[-2^(b-1), 2^(b-1) - 1]``; Slipstream uses the restricted range ``[-(2^(b-1) - 1),
2^(b-1) - 1]`` with ``scale = absmax / (2^(b-1) - 1)``, which is the grid of
``slipstream.kernels.ops.quantize`` (int8: [-127, 127], int4: [-7, 7]). A weight quantized for
training is then stored and served with exactly the codes it trained with.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "asymmetric_codes",
    "binary_codes",
    "fake_quantize",
    "quantize_activation",
    "straight_through",
    "symmetric_codes",
    "ternary_codes",
]

_TINY = 1e-8


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized values exactly. Backward: the gradient passes to ``x`` unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q`` in the forward, the identity with respect to ``x`` in the backward."""
    out: torch.Tensor = _StraightThrough.apply(x, q.detach())
    return out


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    if x.numel() % groups:
        raise ValueError(
            f"quantize_groups = {groups} does not divide the {x.numel()} elements of a weight of "
            f"shape {tuple(x.shape)}; choose a divisor (e.g. the number of output rows)"
        )
    return x.reshape(groups, -1)


def _round(x: torch.Tensor, stochastic: bool) -> torch.Tensor:
    if stochastic:
        return torch.floor(x + torch.rand_like(x))
    return torch.round(x)


def symmetric_codes(
    x: torch.Tensor, bits: int, groups: int, stochastic: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes in ``[-(2^(b-1)-1), 2^(b-1)-1]`` ``(groups, n)`` and fp32 scales ``(groups,)``."""
    grouped = _grouped(x.detach().float(), groups)
    qmax = 2 ** (bits - 1) - 1
    scales = grouped.abs().amax(dim=1) / qmax
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = _round(grouped / scales[:, None], stochastic).clamp(-qmax, qmax)
    return codes, scales


def asymmetric_codes(
    x: torch.Tensor, bits: int, groups: int, stochastic: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes in ``[0, 2^b - 1]``, scales and zero points (``value = (code - zero) * scale``)."""
    grouped = _grouped(x.detach().float(), groups)
    levels = 2**bits - 1
    low = grouped.amin(dim=1).clamp(max=0)
    high = grouped.amax(dim=1).clamp(min=0)
    scales = (high - low) / levels
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    zeros = torch.round(-low / scales)
    codes = (_round(grouped / scales[:, None], stochastic) + zeros[:, None]).clamp(0, levels)
    return codes, scales, zeros


def ternary_codes(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in {-1, 0, 1} and scales: threshold 0.7 * mean |w|, scale the mean kept |w| (TWN)."""
    grouped = _grouped(x.detach().float(), groups)
    threshold = 0.7 * grouped.abs().mean(dim=1, keepdim=True)
    keep = grouped.abs() > threshold
    codes = torch.sign(grouped) * keep
    kept = keep.sum(dim=1).clamp(min=1)
    scales = (grouped.abs() * keep).sum(dim=1) / kept
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    return codes, scales


def binary_codes(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in {-1, 1} and scales: the mean |w| of each group (BWN)."""
    grouped = _grouped(x.detach().float(), groups)
    codes = torch.where(grouped >= 0, 1.0, -1.0)
    scales = grouped.abs().mean(dim=1)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    return codes, scales


def quantized_values(
    x: torch.Tensor, bits: int, groups: int, symmetric: bool = True, stochastic: bool = False
) -> torch.Tensor:
    """The grid values of ``x`` (no gradient), same shape and dtype."""
    if bits == 1:
        codes, scales = binary_codes(x, groups)
        values = codes * scales[:, None]
    elif bits == 2:
        codes, scales = ternary_codes(x, groups)
        values = codes * scales[:, None]
    elif symmetric:
        codes, scales = symmetric_codes(x, bits, groups, stochastic)
        values = codes * scales[:, None]
    else:
        codes, scales, zeros = asymmetric_codes(x, bits, groups, stochastic)
        values = (codes - zeros[:, None]) * scales[:, None]
    return values.reshape(x.shape).to(x.dtype)


def fake_quantize(
    x: torch.Tensor, bits: int, groups: int, symmetric: bool = True, stochastic: bool = False
) -> torch.Tensor:
    """``x`` on the ``bits``-bit grid in the forward, the identity in the backward (STE).

    ``bits`` 1 is binary and 2 ternary (XTC's extreme quantization); 3 and more are integer
    grids, symmetric (see the note on the symmetric grid) or asymmetric with a zero point.
    """
    return straight_through(x, quantized_values(x, bits, groups, symmetric, stochastic))


def quantize_activation(
    x: torch.Tensor,
    bits: int,
    symmetric: bool,
    static_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Token-wise (dynamic: one range per row of the last dimension) or static fake quant (STE)."""
    data = x.detach().float()
    if static_range is None:
        low = data.amin(dim=-1, keepdim=True)
        high = data.amax(dim=-1, keepdim=True)
    else:
        low, high = (t.to(data.device) for t in static_range)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = torch.maximum(low.abs(), high.abs()).clamp(min=_TINY) / qmax
        q = torch.round(data / scale).clamp(-qmax, qmax) * scale
    else:
        levels = 2**bits - 1
        low, high = low.clamp(max=0), high.clamp(min=0)
        scale = ((high - low) / levels).clamp(min=_TINY)
        zero = torch.round(-low / scale)
        q = (torch.round(data / scale) + zero).clamp(0, levels)
        q = (q - zero) * scale
    return straight_through(x, q.to(x.dtype))
