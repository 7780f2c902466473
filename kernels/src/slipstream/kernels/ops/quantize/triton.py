"""Triton group-wise quantize/dequantize: int8, packed int4 and fp8 e4m3 (bit-exact with the reference).

fp8 is encoded and decoded with integer bit arithmetic rather than Triton's fp8 types, so the
same kernel compiles for every target (``sm_80`` has no fp8 conversion instructions, and AMD's
gfx942 natively uses the ``fnuz`` variant) and produces the OCP ``float8_e4m3fn`` bytes that
``torch.float8_e4m3fn`` reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.quantize.reference import QMAX, check_format
from slipstream.kernels.triton_support import AotSpec, check_kernel_device, next_power_of_2

FORMAT_CODES = {"int8": 0, "int4": 1, "fp8_e4m3": 2}
MAX_GROUP_SIZE = 16384  # one group lives in registers


@triton.jit
def _round_half_even(x):
    floor = tl.floor(x)
    frac = x - floor
    odd = (floor - 2.0 * tl.floor(floor * 0.5)) != 0.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), floor + 1.0, floor)


@triton.jit
def _fp8_e4m3_bits(v):
    # v is already clamped to [-448, 448]; returns the e4m3fn byte as int32.
    v_bits = v.to(tl.int32, bitcast=True)
    sign = (v_bits >> 31) & 1
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): rebias the exponent (127 -> 7) and round the 23-bit mantissa to
    # 3 bits, nearest-even, in one integer add; a mantissa carry rolls into the exponent.
    normal = (bits - (120 << 23) + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    # Subnormal range: the code is round(a * 2^9), nearest-even (code 8 is the smallest normal).
    sub = _round_half_even(a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    code = tl.minimum(code, 126)  # 0x7E = 448, the largest finite e4m3fn value
    return code | (sign << 7)


@triton.jit
def _fp8_e4m3_value(byte):
    sign = tl.where((byte & 0x80) != 0, -1.0, 1.0)
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    normal_bits = ((exponent + 120) << 23) | (mantissa << 20)
    normal = normal_bits.to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2^-9
    magnitude = tl.where(exponent == 0, subnormal, normal)
    magnitude = tl.where((exponent == 15) & (mantissa == 7), float("nan"), magnitude)
    return sign * magnitude


@triton.jit
def quantize_kernel(
    x_ptr,
    data_ptr,
    scales_ptr,
    numel,
    group_size,
    qmax,
    FORMAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per group: absmax, scale, then the codes (two per byte for int4)."""
    group = tl.program_id(0).to(tl.int64)
    first = group * group_size
    cols = tl.arange(0, BLOCK)
    in_group = cols < group_size
    x = tl.load(x_ptr + first + cols, mask=in_group & (first + cols < numel), other=0.0)
    absmax = tl.max(tl.abs(x.to(tl.float32)), axis=0)
    scale = absmax / qmax
    scale = tl.where(scale == 0.0, 1.0, scale)
    tl.store(scales_ptr + group, scale)
    if FORMAT == 1:
        pairs = tl.arange(0, BLOCK // 2)
        in_pairs = pairs < group_size // 2
        even_at = first + 2 * pairs
        even = tl.load(x_ptr + even_at, mask=in_pairs & (even_at < numel), other=0.0)
        odd = tl.load(x_ptr + even_at + 1, mask=in_pairs & (even_at + 1 < numel), other=0.0)
        low = _round_half_even(tl.math.div_rn(even.to(tl.float32), scale))
        high = _round_half_even(tl.math.div_rn(odd.to(tl.float32), scale))
        low = tl.minimum(tl.maximum(low, -7.0), 7.0).to(tl.int32) & 0xF
        high = tl.minimum(tl.maximum(high, -7.0), 7.0).to(tl.int32) & 0xF
        packed = (low | (high << 4)).to(tl.uint8)
        tl.store(data_ptr + group * (group_size // 2) + pairs, packed, mask=in_pairs)
    else:
        # Correctly rounded division, as torch's, so the codes match the reference bit for bit.
        scaled = tl.math.div_rn(x.to(tl.float32), scale)
        if FORMAT == 0:
            codes = tl.minimum(tl.maximum(_round_half_even(scaled), -127.0), 127.0)
            tl.store(data_ptr + first + cols, codes.to(tl.int8), mask=in_group)
        else:
            clamped = tl.minimum(tl.maximum(scaled, -448.0), 448.0)
            tl.store(data_ptr + first + cols, _fp8_e4m3_bits(clamped).to(tl.uint8), mask=in_group)


@triton.jit
def dequantize_kernel(
    data_ptr,
    scales_ptr,
    out_ptr,
    numel,
    group_size,
    FORMAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per group: ``code * scale`` written in the output dtype (tail trimmed)."""
    group = tl.program_id(0).to(tl.int64)
    first = group * group_size
    scale = tl.load(scales_ptr + group)
    if FORMAT == 1:
        pairs = tl.arange(0, BLOCK // 2)
        in_pairs = pairs < group_size // 2
        byte = tl.load(data_ptr + group * (group_size // 2) + pairs, mask=in_pairs, other=0)
        byte = byte.to(tl.int32)
        low = ((byte & 0xF) ^ 8) - 8  # sign-extend two's-complement nibbles
        high = (((byte >> 4) & 0xF) ^ 8) - 8
        even_at = first + 2 * pairs
        out_ty = out_ptr.dtype.element_ty
        tl.store(
            out_ptr + even_at,
            (low.to(tl.float32) * scale).to(out_ty),
            mask=in_pairs & (even_at < numel),
        )
        tl.store(
            out_ptr + even_at + 1,
            (high.to(tl.float32) * scale).to(out_ty),
            mask=in_pairs & (even_at + 1 < numel),
        )
    else:
        cols = tl.arange(0, BLOCK)
        mask = (cols < group_size) & (first + cols < numel)
        raw = tl.load(data_ptr + first + cols, mask=mask, other=0)
        if FORMAT == 0:
            values = raw.to(tl.float32)
        else:
            values = _fp8_e4m3_value(raw.to(tl.int32))
        tl.store(out_ptr + first + cols, (values * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _block(group_size: int) -> int:
    if group_size > MAX_GROUP_SIZE:
        raise ValueError(
            f"quantize (triton): group_size {group_size} is larger than the {MAX_GROUP_SIZE} "
            "elements one program holds; use a smaller group or the reference backend"
        )
    return max(16, next_power_of_2(group_size))


def quantize(x: torch.Tensor, format: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton backend of :func:`slipstream.kernels.ops.quantize.reference.quantize` (same codes)."""
    check_format(format, group_size)
    check_kernel_device("quantize", x)
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    numel = flat.numel()
    groups = -(-numel // group_size)
    if format == "int4":
        data = torch.empty(groups, group_size // 2, dtype=torch.uint8, device=x.device)
    elif format == "int8":
        data = torch.empty(groups, group_size, dtype=torch.int8, device=x.device)
    else:
        data = torch.empty(groups, group_size, dtype=torch.uint8, device=x.device)
    scales = torch.empty(groups, dtype=torch.float32, device=x.device)
    if groups:
        quantize_kernel[(groups,)](
            flat,
            data,
            scales,
            numel,
            group_size,
            QMAX[format],
            FORMAT=FORMAT_CODES[format],
            BLOCK=_block(group_size),
        )
    if format == "fp8_e4m3":
        data = data.view(torch.float8_e4m3fn)
    return data, scales


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Triton backend of :func:`slipstream.kernels.ops.quantize.reference.dequantize`."""
    check_format(format, group_size)
    check_kernel_device("dequantize", data, scales)
    codes = data.view(torch.uint8) if format == "fp8_e4m3" else data
    codes = codes.contiguous()
    out = torch.empty(numel, dtype=dtype, device=data.device)
    groups = codes.shape[0]
    if groups and numel:
        dequantize_kernel[(groups,)](
            codes,
            scales.float().contiguous(),
            out,
            numel,
            group_size,
            FORMAT=FORMAT_CODES[format],
            BLOCK=_block(group_size),
        )
    return out


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    storage = {"int8": "*i8", "int4": "*u8", "fp8_e4m3": "*u8"}
    for dtype in ("fp32", "bf16", "fp16"):
        for format, code in FORMAT_CODES.items():
            specs.append(
                AotSpec(
                    f"quantize[{dtype}->{format}]",
                    quantize_kernel,
                    {
                        "x_ptr": f"*{dtype}",
                        "data_ptr": storage[format],
                        "scales_ptr": "*fp32",
                        "numel": "i64",
                        "group_size": "i32",
                        "qmax": "fp32",
                        "FORMAT": "constexpr",
                        "BLOCK": "constexpr",
                    },
                    {"FORMAT": code, "BLOCK": 256},
                )
            )
            specs.append(
                AotSpec(
                    f"dequantize[{format}->{dtype}]",
                    dequantize_kernel,
                    {
                        "data_ptr": storage[format],
                        "scales_ptr": "*fp32",
                        "out_ptr": f"*{dtype}",
                        "numel": "i64",
                        "group_size": "i32",
                        "FORMAT": "constexpr",
                        "BLOCK": "constexpr",
                    },
                    {"FORMAT": code, "BLOCK": 256},
                )
            )
    return specs
