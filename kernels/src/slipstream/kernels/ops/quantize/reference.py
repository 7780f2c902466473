"""Pure-torch group-wise symmetric quantization to int8, packed int4 and fp8 (e4m3)."""

from __future__ import annotations

import torch

FORMATS = ("int8", "int4", "fp8_e4m3")
# Largest code magnitude per format: symmetric ranges [-127, 127], [-7, 7], [-448, 448].
QMAX = {"int8": 127.0, "int4": 7.0, "fp8_e4m3": 448.0}
STORAGE_DTYPE = {"int8": torch.int8, "int4": torch.uint8, "fp8_e4m3": torch.float8_e4m3fn}
# The dtypes a group scale may be stored in (fp32: exact; 16-bit: rounded up, see round_scales).
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_format(format: str, group_size: int) -> None:
    """Raise ValueError for an unknown format or a group size it cannot use."""
    if format not in FORMATS:
        raise ValueError(f"quantize: format must be one of {FORMATS}, got {format!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"quantize: group_size must be a positive int, got {group_size!r}")
    if format == "int4" and group_size % 2:
        raise ValueError(
            f"quantize: int4 packs two values per byte, so group_size must be even, got "
            f"{group_size}"
        )


def check_scale_dtype(scale_dtype: torch.dtype) -> None:
    """Raise ValueError for a scale dtype the kernels cannot read."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(
            f"quantize: scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}"
        )


def round_scales(scales: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``scales`` in ``scale_dtype``, each rounded UP to the next representable value.

    Rounding up keeps ``|x| / stored_scale <= QMAX`` for every element of the group, so the codes
    computed from the stored scale never clip and every element stays within half a step (of the
    stored scale) of its value. A scale below the dtype's smallest subnormal becomes that
    subnormal (never 0). Raises ValueError when a scale exceeds the dtype's largest finite value
    (fp16: 65504, i.e. a group's largest |weight| above 65504 * QMAX).
    """
    check_scale_dtype(scale_dtype)
    if scale_dtype == torch.float32:
        return scales.float()
    rounded = scales.to(scale_dtype)
    below = rounded.float() < scales
    # the next representable value above a positive finite 16-bit float: its bits plus one
    bumped = (rounded.view(torch.int16) + 1).view(scale_dtype)
    rounded = torch.where(below, bumped, rounded)
    if not bool(torch.isfinite(rounded).all()):
        largest = scales.max().item()
        raise ValueError(
            f"quantize: a group scale ({largest:.6g}) exceeds {scale_dtype}'s largest value "
            f"({torch.finfo(scale_dtype).max:.6g}); store the scales as bfloat16 or float32"
        )
    return rounded


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    count = -(-flat.numel() // group_size)
    padded = torch.zeros(count * group_size, dtype=torch.float32, device=x.device)
    padded[: flat.numel()] = flat  # the tail of the last group is zero-padded
    return padded.view(count, group_size)


def quantize(
    x: torch.Tensor, format: str, group_size: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any shape, read flat) in groups of ``group_size`` consecutive elements.

    Returns ``(data, scales)``: ``scales`` is ``(groups,)`` in ``scale_dtype`` with
    ``scale = absmax(group) / QMAX`` (1 for an all-zero group; a 16-bit ``scale_dtype`` rounds it
    up, :func:`round_scales`, and the codes are computed from the rounded scale), and ``data`` is
    ``(groups, group_size)`` (``group_size // 2`` bytes per group for int4), the last group
    zero-padded:

    - ``int8``: ``round(x / scale)`` (half to even) clamped to [-127, 127], ``torch.int8``;
    - ``int4``: the same clamped to [-7, 7], two's-complement nibbles packed into ``torch.uint8``,
      element ``2i`` in the low nibble and ``2i + 1`` in the high one;
    - ``fp8_e4m3``: ``x / scale`` clamped to [-448, 448] and rounded to ``torch.float8_e4m3fn``
      (the OCP e4m3 format, also on AMD GPUs whose native fp8 is the ``fnuz`` variant).

    ``x / scale`` is one correctly rounded fp32 division, so every backend gets the same codes.
    """
    check_format(format, group_size)
    check_scale_dtype(scale_dtype)
    groups = _groups(x, group_size)
    scales = groups.abs().amax(dim=1) / QMAX[format]
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    stored = round_scales(scales, scale_dtype)
    return encode(groups, stored.float(), format), stored


def encode(groups: torch.Tensor, scales: torch.Tensor, format: str) -> torch.Tensor:
    """The codes of fp32 ``groups`` ``(groups, group_size)`` for the given fp32 ``scales``
    (:func:`quantize`'s rounding and clamping)."""
    scaled = groups / scales[:, None]
    if format == "fp8_e4m3":
        return scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    codes = torch.round(scaled).clamp(-QMAX[format], QMAX[format]).to(torch.int8)
    if format == "int8":
        return codes
    low = codes[:, 0::2].to(torch.uint8) & 0xF  # int8 -> uint8 keeps the two's-complement bits
    high = codes[:, 1::2].to(torch.uint8) & 0xF
    return low | (high << 4)


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Invert :func:`quantize`: ``code * scale`` per group, flat ``(numel,)`` in ``dtype``."""
    check_format(format, group_size)
    if format == "int4":
        packed = data.to(torch.int16)
        low = ((packed & 0xF) ^ 8) - 8  # sign-extend the 4-bit two's complement
        high = (((packed >> 4) & 0xF) ^ 8) - 8
        codes = torch.stack((low, high), dim=-1).reshape(data.shape[0], group_size).float()
    else:
        codes = data.float()
    values = codes * scales[:, None].float()
    return values.reshape(-1)[:numel].to(dtype)
