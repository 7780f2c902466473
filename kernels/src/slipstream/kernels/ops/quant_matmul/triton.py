"""Triton weight-only quantized matmul: int8, packed int4 and fp8 (e4m3) codes read in place.

Decode multiplies a few activation rows by every weight once, so its speed is the speed of
streaming the weight bytes: reading 1 (int8, fp8) or 0.5 (int4) bytes per weight instead of 2
is the whole gain, and it is lost if the weight is first dequantized into a bf16 copy.

One kernel serves every row count. Program ``(n, m, s)`` owns a ``BLOCK_M x BLOCK_N`` output
tile and K-split ``s``; it walks its share of K in ``BLOCK_K`` steps (``BLOCK_K`` divides the
quantization group, so one scale per output column per step), loads the codes of the step
``(BLOCK_K, BLOCK_N)`` straight from the row-major ``(out, in)`` code matrix (each output
row's codes are contiguous, so every column of the tile is one coalesced run of bytes),
converts them to the activation dtype in registers (exact: int8/int4 codes and e4m3 values
are representable in bf16/fp16), multiplies on the tensor cores with ``tl.dot`` (fp32
accumulation), and scales the step's partial product per output column. Small M pads the tile
to 16 rows: the wasted MMA work is free in a bandwidth-bound kernel, and many narrow ``BLOCK_N``
programs (plus optional split-K, summed with fp32 atomics) keep every SM streaming.

- int4: the two's-complement nibbles of ``quantize`` (element ``2i`` low, ``2i + 1`` high) are
  not reordered; the kernel multiplies the low nibbles by the even activation columns and the
  high ones by the odd columns (two dots of ``BLOCK_K / 2``), so the weight needs no repacking.
- fp8: the e4m3fn byte is rebuilt as an fp16 bit pattern with integer ops (sign to bit 15,
  exponent and mantissa shifted by 7), which is the value times 2^-8 for normals and
  subnormals alike; the 2^8 folds into the scale. This compiles for every target (``sm_80``
  has no fp8 conversions, gfx942's native fp8 is the ``fnuz`` variant). The NaN byte (never
  produced by ``quantize``, which clamps to +-448) decodes as 480 here.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slipstream.kernels.ops.quant_matmul.gemv import aot_specs as gemv_aot_specs
from slipstream.kernels.ops.quant_matmul.gemv import (
    dequantize_packed,
    gemv_default_config,
    launch_gemv,
)
from slipstream.kernels.ops.quant_matmul.reference import (
    check_weight,
    dequantize_weight,
)
from slipstream.kernels.ops.quant_matmul.reference import quant_matmul as reference_quant_matmul
from slipstream.kernels.triton_support import AotSpec, check_kernel_device, interpreting

__all__ = [
    "FORMAT_CODES",
    "QuantMatmulConfig",
    "default_config",
    "launch",
    "quant_matmul",
    "quant_matmul_packed",
]

FORMAT_CODES = {"int8": 0, "int4": 1, "fp8_e4m3": 2}
# Above this many rows (prefill) the weight is dequantized once into a scratch of the activation
# dtype by a bandwidth-bound Triton kernel and cuBLAS multiplies: the tiled kernel measured 2-14x
# slower than bf16 cuBLAS at 128-512 rows on an H100 (tools/bench/quant_gemv_bench.py).
DEQUANTIZE_ABOVE_ROWS = 16


@dataclasses.dataclass(frozen=True)
class QuantMatmulConfig:
    """Tile shape and launch options of one :func:`launch`."""

    block_m: int = 16
    block_n: int = 16
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def quant_matmul_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    FORMAT: tl.constexpr,  # 0 int8, 1 int4, 2 fp8 e4m3, 3 dense (x's dtype; scales unused)
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 activations: exact fp32 products, not tf32
):
    """out[m, n] = sum_k x[m, k] * code[n, k] * scale[n, k // GROUP] (+ bias[n])."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    groups = K // GROUP
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    x_type = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    col_offsets = cols.to(tl.int64)
    for step in range(first, last):
        k0 = step * BLOCK_K
        if FORMAT != 3:
            scale = tl.load(scales_ptr + col_offsets * groups + k0 // GROUP, mask=col_ok, other=0.0)
            scale = scale.to(tl.float32)  # fp32, fp16 or bf16 scales
        if FORMAT == 1:
            j = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                codes_ptr + col_offsets[None, :] * (K // 2) + (k0 // 2 + j)[:, None],
                mask=col_ok[None, :],
                other=0,
            )
            k = tl.arange(0, BLOCK_K)
            xk = tl.load(x_rows + (k0 + k)[None, :], mask=row_ok[:, None], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(xk, (BLOCK_M, BLOCK_K // 2, 2)))
            if IEEE:
                wide = packed.to(tl.int32)
                low = (((wide & 15) ^ 8) - 8).to(tl.float32)
                high = ((((wide >> 4) & 15) ^ 8) - 8).to(tl.float32)
                part = tl.dot(x_even, low, input_precision="ieee")
                part += tl.dot(x_odd, high, input_precision="ieee")
            else:
                # No integer-to-float conversions: each nibble (two's complement, made offset
                # binary u = code + 8 by xor 8) is placed in the mantissa of 16.0, where one
                # unit of the field is 1.0 (bf16: bits 3-6; fp16: bits 6-9), giving the value
                # 16 + u = code + 24 exactly; the dot is corrected by 24 * sum(x) per row.
                flipped = packed.to(tl.int16) ^ 0x88
                if x_type == tl.float16:
                    low = ((flipped << 6) & 0x3C0) | 0x4C00
                    high = ((flipped << 2) & 0x3C0) | 0x4C00
                else:
                    low = ((flipped << 3) & 0x78) | 0x4180
                    high = ((flipped >> 1) & 0x78) | 0x4180
                part = tl.dot(x_even, low.to(x_type, bitcast=True))
                part += tl.dot(x_odd, high.to(x_type, bitcast=True))
                part -= 24.0 * tl.sum(xk.to(tl.float32), axis=1)[:, None]
        else:
            k = tl.arange(0, BLOCK_K)
            raw = tl.load(
                codes_ptr + col_offsets[None, :] * K + (k0 + k)[:, None],
                mask=col_ok[None, :],
                other=0,
            )
            if FORMAT == 2:
                byte = raw.to(tl.int32) & 0xFF
                half_bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
                w = half_bits.to(tl.int16).to(tl.float16, bitcast=True)
                if x_type != tl.float16:
                    w = w.to(tl.float32).to(x_type)
            elif FORMAT == 3:
                w = raw  # a dense weight in the activation dtype
            else:
                w = raw.to(tl.float32).to(x_type)
            xk = tl.load(x_rows + (k0 + k)[None, :], mask=row_ok[:, None], other=0.0)
            if IEEE:
                part = tl.dot(xk, w, input_precision="ieee")
            else:
                part = tl.dot(xk, w)
        if FORMAT == 3:
            acc += part
        else:
            acc += part * scale[None, :]
    if FORMAT == 2:
        acc = acc * 256.0  # the fp16 bit pattern holds the e4m3 value times 2^-8
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]  # split-K: the first split adds it
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    keep = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.atomic_add(out_ptrs, acc, mask=keep)


@triton.jit
def dequantize_rows_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    N,
    K,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[n, k] = code[n, k] * scale[n, k // GROUP] in fp32, rounded once to out's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    col_ok = cols < N
    rows64 = cols.to(tl.int64)
    scale = tl.load(scales_ptr + rows64 * (K // GROUP) + k0 // GROUP, mask=col_ok, other=0.0)
    scale = scale.to(tl.float32)
    k = tl.arange(0, BLOCK_K)
    if FORMAT == 1:
        j = tl.arange(0, BLOCK_K // 2)
        packed = tl.load(
            codes_ptr + rows64[:, None] * (K // 2) + (k0 // 2 + j)[None, :],
            mask=col_ok[:, None],
            other=0,
        ).to(tl.int32)
        low = (((packed & 15) ^ 8) - 8).to(tl.float32)
        high = ((((packed >> 4) & 15) ^ 8) - 8).to(tl.float32)
        values = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))  # k = 2j low, 2j + 1 high
    else:
        raw = tl.load(
            codes_ptr + rows64[:, None] * K + (k0 + k)[None, :], mask=col_ok[:, None], other=0
        )
        if FORMAT == 2:
            byte = raw.to(tl.int32) & 0xFF
            half_bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
            values = half_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        else:
            values = raw.to(tl.float32)
    out = values * scale[:, None]
    tl.store(
        out_ptr + rows64[:, None] * K + (k0 + k)[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=col_ok[:, None],
    )


def dequantize_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``(out, in)`` weight in ``dtype``, equal to the reference's (fp32 product, one rounding)."""
    out_features = check_weight(codes, scales, format, group_size, in_features)
    block_k = _block_k(format, group_size)
    if block_k is None:
        return dequantize_weight(codes, scales, format, group_size, in_features, dtype)
    if codes.dtype != torch.uint8 and codes.dtype != torch.int8:
        codes = codes.view(torch.uint8)
    out = torch.empty(out_features, in_features, device=codes.device, dtype=dtype)
    grid = (triton.cdiv(out_features, 32), in_features // block_k)
    dequantize_rows_kernel[grid](
        codes,
        scales,
        out,
        out_features,
        in_features,
        FORMAT=FORMAT_CODES[format],
        GROUP=group_size,
        BLOCK_N=32,
        BLOCK_K=block_k,
    )
    return out


def _block_k(format: str, group_size: int) -> int | None:
    """The largest power-of-two step <= 128 dividing the group (None if below tl.dot's 16)."""
    smallest = 32 if format == "int4" else 16  # int4 dots half a step per nibble
    block = 128
    while block >= smallest:
        if group_size % block == 0:
            return block
        block //= 2
    return None


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def default_config(
    rows: int,
    out_features: int,
    in_features: int,
    format: str,
    group_size: int,
    device: torch.device,
) -> QuantMatmulConfig | None:
    """The launch used when none is given; None when the kernel cannot run this shape.

    Few rows (decode): a 16-row tile over 32 columns, split-K when the columns give too few
    programs to keep every SM streaming. More rows: 64 x 64 tiles (the op itself dequantizes
    and calls the matmul library above ``DEQUANTIZE_ABOVE_ROWS``).
    """
    block_k = _block_k(format, group_size)
    if block_k is None:
        return None
    if rows > 16:
        return QuantMatmulConfig(block_m=64, block_n=64, block_k=block_k, num_stages=3)
    # The H100 sweep's winners (tools/bench/quant_gemv_bench.py --sweep, Llama-8B shapes, all
    # formats, 1-16 rows): 32-column blocks, 4 warps, 3 stages; no split when the columns
    # alone give >= 4 programs per SM (gate/up), else split K in 4 (QKV, output, down),
    # which beat the unsplit kernel there even with its zero-fill and cast launches.
    sms = _multiprocessors(device)
    programs = triton.cdiv(out_features, 32)
    steps = in_features // block_k
    split = 1 if programs >= 4 * sms else (2 if programs >= 2 * sms else 4)
    while split > 1 and steps < split:
        split //= 2
    return QuantMatmulConfig(block_n=32, block_k=block_k, split_k=split, num_stages=3)


def launch(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None,
    config: QuantMatmulConfig,
) -> torch.Tensor:
    """Run the kernel with an explicit ``config`` (benchmarks sweep this; callers use
    :func:`quant_matmul`). Returns ``(..., out_features)`` in ``x.dtype``."""
    in_features = x.shape[-1]
    out_features = check_weight(codes, scales, format, group_size, in_features)
    if group_size % config.block_k:
        raise ValueError(
            f"quant_matmul: block_k {config.block_k} must divide group_size {group_size}"
        )
    flat = x.reshape(-1, in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    if codes.dtype != torch.uint8 and codes.dtype != torch.int8:
        codes = codes.view(torch.uint8)  # float8_e4m3fn: the kernel decodes the bytes itself
    split = config.split_k
    out = (
        torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
        if split == 1
        else torch.zeros(rows, out_features, device=x.device, dtype=torch.float32)
    )
    grid = (
        triton.cdiv(out_features, config.block_n),
        triton.cdiv(rows, config.block_m),
        split,
    )
    quant_matmul_kernel[grid](
        flat,
        codes,
        scales,
        bias if bias is not None else scales,
        out,
        rows,
        out_features,
        in_features,
        flat.stride(0),
        out.stride(0),
        FORMAT=FORMAT_CODES[format],
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        IEEE=x.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split != 1:
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


def quant_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` reading the quantized ``W`` in place (see the module docstring).

    Shapes the kernel cannot tile (a group not a multiple of 16, or 32 for int4) run the
    reference; inputs of more than ``DEQUANTIZE_ABOVE_ROWS`` rows dequantize the weight with
    :func:`dequantize_rows`, then multiply.
    """
    check_kernel_device("quant_matmul", x, codes, scales, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    config = default_config(rows, -1, x.shape[-1], format, group_size, x.device)
    if config is None or rows == 0:
        return reference_quant_matmul(x, codes, scales, format, group_size, bias)
    if rows > DEQUANTIZE_ABOVE_ROWS:
        weight = dequantize_rows(codes, scales, format, group_size, x.shape[-1], x.dtype)
        return F.linear(x, weight, bias)
    out_features = check_weight(codes, scales, format, group_size, x.shape[-1])
    config = default_config(rows, out_features, x.shape[-1], format, group_size, x.device)
    assert config is not None
    if interpreting() and config.split_k > 1:
        config = dataclasses.replace(config, split_k=1)  # the interpreter has no fast atomics
    return launch(x, codes, scales, format, group_size, bias, config)


# Rows up to which quant_matmul_packed runs the gemv kernel (one program per row; the programs
# of one weight tile run side by side, so the weight comes from HBM about once and the rows cost
# unpacking work); above, the weight is dequantized once into the activation dtype for cuBLAS.
GEMV_MAX_ROWS = 8


def quant_matmul_packed(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` for a weight in :func:`.gemv.pack_gemv`'s layout: the gemv kernel for
    at most ``GEMV_MAX_ROWS`` rows, else :func:`.gemv.dequantize_packed`, then cuBLAS (prefill)."""
    check_kernel_device("quant_matmul_packed", x, words, scales, bias)
    in_features = x.shape[-1]
    rows = x.numel() // max(in_features, 1)
    if 0 < rows <= GEMV_MAX_ROWS:
        out_features = words.numel() * (8 if format == "int4" else 4) // in_features
        config = gemv_default_config(format, out_features, in_features, group_size, x.device)
        if config is not None:
            if interpreting() and config.split_k > 1:
                config = dataclasses.replace(config, split_k=1)
            return launch_gemv(x, words, scales, format, group_size, bias, config)
    weight = dequantize_packed(words, scales, format, group_size, in_features, x.dtype)
    return F.linear(x, weight, bias)


DENSE_GEMV_MAX_ROWS = 16


def dense_gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows through the same streaming kernel (dense
    weights in ``x.dtype``): an alternative to cuBLAS's GEMV at decode, which the H100 profile
    found at 1.5-1.8 TB/s on Llama-8B's QKV and output shapes. More rows, other dtypes or a
    K not a multiple of 16: ``F.linear``."""
    check_kernel_device("dense_gemv", x, weight, bias)
    out_features, in_features = weight.shape
    rows = x.numel() // max(in_features, 1)
    block_k = _block_k("int8", in_features)
    if (
        rows == 0
        or rows > DENSE_GEMV_MAX_ROWS
        or block_k is None
        or weight.dtype != x.dtype
        or x.dtype == torch.float32
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    sms = _multiprocessors(x.device)
    programs = triton.cdiv(out_features, 32)
    steps = in_features // block_k
    split = 1 if programs >= 4 * sms else (2 if programs >= 2 * sms else 4)
    while split > 1 and steps < split:
        split //= 2
    if interpreting():
        split = 1
    config = QuantMatmulConfig(block_n=32, block_k=block_k, split_k=split, num_stages=3)
    flat = x.reshape(-1, in_features)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = (
        torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
        if split == 1
        else torch.zeros(rows, out_features, device=x.device, dtype=torch.float32)
    )
    grid = (triton.cdiv(out_features, config.block_n), 1, split)
    quant_matmul_kernel[grid](
        flat,
        weight,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        out_features,
        in_features,
        flat.stride(0),
        out.stride(0),
        FORMAT=3,
        GROUP=block_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=split,
        IEEE=False,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split != 1:
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


def aot_specs() -> list[AotSpec]:
    """The specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    storage = {"int8": "*i8", "int4": "*u8", "fp8_e4m3": "*u8"}
    for dtype in ("bf16", "fp16"):
        for format, code in FORMAT_CODES.items():
            for split, block_m, block_n in ((1, 16, 16), (2, 16, 32), (1, 64, 64)):
                specs.append(
                    AotSpec(
                        f"quant_matmul[{format}x{dtype},m{block_m}n{block_n}s{split}]",
                        quant_matmul_kernel,
                        {
                            "x_ptr": f"*{dtype}",
                            "codes_ptr": storage[format],
                            "scales_ptr": "*fp32",
                            "bias_ptr": f"*{dtype}",
                            "out_ptr": f"*{dtype}" if split == 1 else "*fp32",
                            "M": "i32",
                            "N": "i32",
                            "K": "i32",
                            "stride_xm": "i32",
                            "stride_om": "i32",
                            "FORMAT": "constexpr",
                            "GROUP": "constexpr",
                            "HAS_BIAS": "constexpr",
                            "BLOCK_M": "constexpr",
                            "BLOCK_N": "constexpr",
                            "BLOCK_K": "constexpr",
                            "SPLIT_K": "constexpr",
                            "IEEE": "constexpr",
                        },
                        {
                            "FORMAT": code,
                            "GROUP": 128,
                            "HAS_BIAS": False,
                            "BLOCK_M": block_m,
                            "BLOCK_N": block_n,
                            "BLOCK_K": 128,
                            "SPLIT_K": split,
                            "IEEE": False,
                        },
                    )
                )
    for dtype in ("bf16", "fp16"):
        for split in (1, 4):
            specs.append(
                AotSpec(
                    f"quant_matmul.dense_gemv[{dtype},s{split}]",
                    quant_matmul_kernel,
                    {
                        "x_ptr": f"*{dtype}",
                        "codes_ptr": f"*{dtype}",
                        "scales_ptr": f"*{dtype}",
                        "bias_ptr": f"*{dtype}",
                        "out_ptr": f"*{dtype}" if split == 1 else "*fp32",
                        "M": "i32",
                        "N": "i32",
                        "K": "i32",
                        "stride_xm": "i32",
                        "stride_om": "i32",
                        "FORMAT": "constexpr",
                        "GROUP": "constexpr",
                        "HAS_BIAS": "constexpr",
                        "BLOCK_M": "constexpr",
                        "BLOCK_N": "constexpr",
                        "BLOCK_K": "constexpr",
                        "SPLIT_K": "constexpr",
                        "IEEE": "constexpr",
                    },
                    {
                        "FORMAT": 3,
                        "GROUP": 128,
                        "HAS_BIAS": False,
                        "BLOCK_M": 16,
                        "BLOCK_N": 32,
                        "BLOCK_K": 128,
                        "SPLIT_K": split,
                        "IEEE": False,
                    },
                )
            )
        for format, code in FORMAT_CODES.items():
            specs.append(
                AotSpec(
                    f"quant_matmul.dequantize_rows[{format}->{dtype}]",
                    dequantize_rows_kernel,
                    {
                        "codes_ptr": storage[format],
                        "scales_ptr": "*fp32",
                        "out_ptr": f"*{dtype}",
                        "N": "i32",
                        "K": "i32",
                        "FORMAT": "constexpr",
                        "GROUP": "constexpr",
                        "BLOCK_N": "constexpr",
                        "BLOCK_K": "constexpr",
                    },
                    {"FORMAT": code, "GROUP": 128, "BLOCK_N": 32, "BLOCK_K": 128},
                )
            )
    specs.extend(gemv_aot_specs())
    return specs
