"""Decode GEMV on the CUDA cores for int4 / int8 weights repacked for it, and for dense weights.

At batch-1 decode every weight is read once and used for one multiply-add, so the kernel must
stream at memory bandwidth; for int4 that means unpacking ~6e12 weights/s on an H100, which
per-element integer ops and int-to-float conversions cannot reach. This kernel spends about two
instructions per int4 weight on NVIDIA (``half2``), three elsewhere, and no layout shuffles:

- **Packed layout** (:func:`pack_gemv`, done once at load time). The codes are int32 words of 8
  nibbles (int4) or 4 bytes (int8). Blocks of ``PACK = 16 * per_word`` consecutive input
  features (128 for int4, 64 for int8) are stored as 16 words per output row; field ``f =
  2p + b`` of word ``jj`` holds element ``32p + 2jj + b`` of the block. So the activation pair
  ``(x[32p + 2jj], x[32p + 2jj + 1])`` that field pair ``p`` of word ``jj`` needs is the int32 at
  pair index ``16p + jj``: contiguous in ``jj`` exactly like the words, so the activations and
  the codes are loaded in one register layout (four int32 per thread) and nothing is moved
  between threads in the loop. The quantization group must be a multiple of ``PACK``.
- **Unpacking without conversions.** Each word is xor-ed once into offset binary (``u = code +
  8`` / ``+ 128``). A field at bit ``a`` is masked in place and or-ed into a float whose
  exponent makes one unit of bit ``a`` worth 1.0, i.e. ``2^(23 - a)`` (one LOP3), so subtracting
  ``2^(23 - a) + 8`` (one FADD, exact) leaves the code itself, and one FFMA accumulates it
  times the activation in fp32. Fields at or above mantissa bit 20 are shifted down once per
  word first. The group scale multiplies a per-group partial sum, not each weight. This fp32
  path runs on AMD, the CPU interpreter, fp8, and wherever ``GemvConfig.half2`` is off.
- **f16x2 unpacking** (``half2``, NVIDIA, 16-bit activations; inline PTX in
  :func:`_half2_word_sums` / :func:`_half2_quad_sums`). One ``lop3`` takes two fields of a word
  (one per 16-bit half), flips them to offset binary and ors them into the mantissa of fp16 1024;
  one f16x2 ``fma`` maps both to the code over a power of two, exactly; f16x2 ``fma``s multiply
  by the activations (converted to f16x2 once per step, shared by the program's rows) and sum a
  word's (``quads``: a thread's four words') products, converted to fp32 once. The scaling keeps
  every f16 partial sum within the largest |activation| (no overflow below 65504).
- **Prefetch** (``prefetch``): the next step's codes and scales are loaded before the current
  step's math; no load is masked (rows past N re-read row N - 1, the prefetch past the last
  step re-reads it).
- **Tiles.** A program owns ``block_n`` output rows of one activation row and a K range (split-K:
  each split leaves its fp32 sums in a workspace slice, the last to arrive adds them in split
  order, so the result does not depend on the arrival order; without that workspace, while a
  CUDA graph is captured, fp32 atomics into a zeroed output). A step covers ``8 * num_warps`` packed blocks, so that a step's
  activations fill exactly four int32 per thread (what keeps the two layouts equal).

Dense weights (``format="dense"``, the activation dtype) take the same tiling with 8 bf16 per
thread. :func:`unpack_gemv` inverts the packing (the prefill path and the reference use it).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from slipstream.kernels.ops.quant_matmul.packing import (
    PER_WORD,
    check_packable,
    pack_block,
    pack_gemv,
    unpack_gemv,
)
from slipstream.kernels.ops.quant_matmul.reference import check_weight
from slipstream.kernels.triton_support import AotSpec, interpreting

__all__ = [
    "GEMV_FORMAT_CODES",
    "GEMV_TABLE",
    "GemvConfig",
    "dequantize_packed",
    "gemv_block_k",
    "gemv_default_config",
    "gemv_kernel",
    "gemv_supports",
    "half2_supported",
    "launch_gemv",
    "pack_block",
    "pack_gemv",
    "unpack_gemv",
]

GEMV_FORMAT_CODES = {"int8": 0, "int4": 1, "fp8_e4m3": 2, "dense": 3}


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch of :func:`gemv_kernel`: output rows per program, warps (which also fix the step:
    :func:`gemv_block_k`), K splits."""

    block_n: int = 8
    num_warps: int = 1
    split_k: int = 1
    num_stages: int = 2
    # int4/int8 on NVIDIA with 16-bit activations: unpack and multiply two weights per
    # instruction in f16x2 (see the module docstring); elsewhere the fp32 path runs.
    half2: bool = False
    # Load the next step's codes and scales before computing on the current ones.
    prefetch: bool = False
    # With half2: one f16x2 accumulator per thread's four words (a quarter of the conversions
    # to fp32 and of the scale fmas; the products are summed over 16 terms in f16).
    quads: bool = False


def gemv_block_k(format: str, num_warps: int) -> int:
    """Input features per loop step: 4 int32 (or 8 dense elements) of activations per thread."""
    if format == "dense":
        return 256 * num_warps
    return 8 * num_warps * pack_block(format)


def gemv_supports(format: str, group_size: int, in_features: int, config: GemvConfig) -> bool:
    """Whether :func:`launch_gemv` can run this weight with ``config``."""
    if format not in GEMV_FORMAT_CODES:
        return False
    if in_features % gemv_block_k(format, config.num_warps):
        return False
    return format == "dense" or group_size % pack_block(format) == 0


# PTX for HALF2 (NVIDIA only; the launcher never sets HALF2 elsewhere). A field of the packed
# word, made offset binary by xor-ing its top bit, is or-ed into the mantissa of fp16 1024 (two
# fields per lop3: one in each half, at bits 0-3 / 4-7 / 0-7 of the half), so the half is
# 1024 + u, or 1024 + 16u for a nibble at bits 4-7, exactly; one f16x2 fma maps both to
# code / 32 (int4) or code / 256 (int8), exactly (the scaling keeps a 4-term f16 sum of
# |weight| * |x| within |x|, so nothing overflows below fp16's max); f16x2 fmas accumulate the
# products of one word (4 per half for int4, 2 for int8), and the two halves are added in fp32.
# lop3 0x6a: (a & b) ^ c, with c = the magic exponent | the offset-binary top bits.


@triton.jit
def _x_half2(lo, hi, X_BF16: tl.constexpr):
    """Two int32 activation pairs -> two f16x2: (lo.low, hi.low) and (lo.high, hi.high)."""
    if X_BF16:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 al, ah, bl, bh;
            shl.b32 al, $2, 16;
            and.b32 ah, $2, 0xffff0000;
            shl.b32 bl, $3, 16;
            and.b32 bh, $3, 0xffff0000;
            cvt.rn.f16x2.f32 $0, bl, al;
            cvt.rn.f16x2.f32 $1, bh, ah;
            }""",
            "=r,=r,r,r",
            [lo, hi],
            dtype=(tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    return tl.inline_asm_elementwise(
        """{
        prmt.b32 $0, $2, $3, 0x5410;
        prmt.b32 $1, $2, $3, 0x7632;
        }""",
        "=r,=r,r,r",
        [lo, hi],
        dtype=(tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _half2_word_sums(words, xpairs, FORMAT: tl.constexpr, X_BF16: tl.constexpr):
    """Per packed word: sum of its fields' codes times their activations, divided by 32 (int4)
    or 256 (int8), as fp32. ``xpairs``: pointers to the int32 activation pair of field pair 0."""
    if FORMAT == 1:
        # word jj: fields (0, 4) are elements (2jj, 64 + 2jj), (1, 5) the next ones, and
        # (2, 6) / (3, 7) the same at 32 + ...: activation pairs 16p + jj, p = 0 .. 3
        xa, xb = _x_half2(tl.load(xpairs), tl.load(xpairs + 32), X_BF16)
        xc, xd = _x_half2(tl.load(xpairs + 16), tl.load(xpairs + 48), X_BF16)
        part = tl.inline_asm_elementwise(
            """{
            .reg .b32 s, a, b, c, d, k5, k9, n5, n9, acc;
            .reg .b16 lo, hi;
            .reg .f32 fl, fh;
            mov.b32 k5, 0x28002800;
            mov.b32 k9, 0x18001800;
            mov.b32 n5, 0xd008d008;
            mov.b32 n9, 0xc080c080;
            shr.u32 s, $1, 8;
            lop3.b32 a, $1, 0x000f000f, 0x64086408, 0x6a;
            lop3.b32 b, $1, 0x00f000f0, 0x64806480, 0x6a;
            lop3.b32 c, s, 0x000f000f, 0x64086408, 0x6a;
            lop3.b32 d, s, 0x00f000f0, 0x64806480, 0x6a;
            fma.rn.f16x2 a, a, k5, n5;
            fma.rn.f16x2 b, b, k9, n9;
            fma.rn.f16x2 c, c, k5, n5;
            fma.rn.f16x2 d, d, k9, n9;
            mul.rn.f16x2 acc, a, $2;
            fma.rn.f16x2 acc, b, $3, acc;
            fma.rn.f16x2 acc, c, $4, acc;
            fma.rn.f16x2 acc, d, $5, acc;
            mov.b32 {lo, hi}, acc;
            cvt.f32.f16 fl, lo;
            cvt.f32.f16 fh, hi;
            add.f32 fl, fl, fh;
            mov.b32 $0, fl;
            }""",
            "=r,r,r,r,r,r",
            [words, xa, xb, xc, xd],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        # int8 word jj: fields (0, 2) are elements (2jj, 32 + 2jj), (1, 3) the next ones
        xa, xb = _x_half2(tl.load(xpairs), tl.load(xpairs + 16), X_BF16)
        part = tl.inline_asm_elementwise(
            """{
            .reg .b32 s, a, b, k8, n8, acc;
            .reg .b16 lo, hi;
            .reg .f32 fl, fh;
            mov.b32 k8, 0x1c001c00;
            mov.b32 n8, 0xc480c480;
            shr.u32 s, $1, 8;
            lop3.b32 a, $1, 0x00ff00ff, 0x64806480, 0x6a;
            lop3.b32 b, s, 0x00ff00ff, 0x64806480, 0x6a;
            fma.rn.f16x2 a, a, k8, n8;
            fma.rn.f16x2 b, b, k8, n8;
            mul.rn.f16x2 acc, a, $2;
            fma.rn.f16x2 acc, b, $3, acc;
            mov.b32 {lo, hi}, acc;
            cvt.f32.f16 fl, lo;
            cvt.f32.f16 fh, hi;
            add.f32 fl, fl, fh;
            mov.b32 $0, fl;
            }""",
            "=r,r,r,r",
            [words, xa, xb],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    return part.to(tl.float32, bitcast=True)


@triton.jit
def _split4(t):
    """``(B, G, 16)`` -> four ``(B, G, 4)``: elements 4q, 4q + 1, 4q + 2, 4q + 3 (the four words
    one thread loads in one 16-byte access; split in registers)."""
    a, b = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 4, 2, 2)))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _half2_quad_sums(words, xpairs, FORMAT: tl.constexpr, X_BF16: tl.constexpr):
    """:func:`_half2_word_sums` over the four consecutive words of one thread (one quantization
    group): their products are summed in one f16x2 accumulator, so the f16 -> fp32 conversion,
    the fp32 add and the scale's fma run once per four words. Weights are code / 128 (int4) or
    code / 1024 (int8) here, which keeps a 16-term (8-term) f16 sum within |x|. Returns
    ``(B, G, 4)`` fp32 sums, one per quad."""
    if FORMAT == 1:
        xa, xb = _x_half2(tl.load(xpairs), tl.load(xpairs + 32), X_BF16)
        xc, xd = _x_half2(tl.load(xpairs + 16), tl.load(xpairs + 48), X_BF16)
    else:
        xa, xb = _x_half2(tl.load(xpairs), tl.load(xpairs + 16), X_BF16)
        xc, xd = xa, xb
    return _half2_quad_dot(words, xa, xb, xc, xd, FORMAT)


@triton.jit
def _half2_quad_dot(words, xa, xb, xc, xd, FORMAT: tl.constexpr):
    """:func:`_half2_quad_sums` from the activations already in f16x2 (``xa .. xd``: int4's
    four field pairs; int8 reads ``xa`` and ``xb`` only)."""
    w0, w1, w2, w3 = _split4(words)
    if FORMAT == 1:
        a0, a1, a2, a3 = _split4(xa)
        b0, b1, b2, b3 = _split4(xb)
        c0, c1, c2, c3 = _split4(xc)
        d0, d1, d2, d3 = _split4(xd)
        part = tl.inline_asm_elementwise(
            """{
                    .reg .b32 s, a, b, c, d, k7, k11, n7, n11, acc;
                    .reg .b16 lo, hi;
                    .reg .f32 fl, fh;
                    mov.b32 k7, 0x20002000;
                    mov.b32 k11, 0x10001000;
                    mov.b32 n7, 0xc808c808;
                    mov.b32 n11, 0xb880b880;
                    shr.u32 s, $1, 8;
                    lop3.b32 a, $1, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 b, $1, 0x00f000f0, 0x64806480, 0x6a;
                    lop3.b32 c, s, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 d, s, 0x00f000f0, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k7, n7;
                    fma.rn.f16x2 b, b, k11, n11;
                    fma.rn.f16x2 c, c, k7, n7;
                    fma.rn.f16x2 d, d, k11, n11;
                    mul.rn.f16x2 acc, a, $5;
                    fma.rn.f16x2 acc, b, $6, acc;
                    fma.rn.f16x2 acc, c, $7, acc;
                    fma.rn.f16x2 acc, d, $8, acc;
                    shr.u32 s, $2, 8;
                    lop3.b32 a, $2, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 b, $2, 0x00f000f0, 0x64806480, 0x6a;
                    lop3.b32 c, s, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 d, s, 0x00f000f0, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k7, n7;
                    fma.rn.f16x2 b, b, k11, n11;
                    fma.rn.f16x2 c, c, k7, n7;
                    fma.rn.f16x2 d, d, k11, n11;
                    fma.rn.f16x2 acc, a, $9, acc;
                    fma.rn.f16x2 acc, b, $10, acc;
                    fma.rn.f16x2 acc, c, $11, acc;
                    fma.rn.f16x2 acc, d, $12, acc;
                    shr.u32 s, $3, 8;
                    lop3.b32 a, $3, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 b, $3, 0x00f000f0, 0x64806480, 0x6a;
                    lop3.b32 c, s, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 d, s, 0x00f000f0, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k7, n7;
                    fma.rn.f16x2 b, b, k11, n11;
                    fma.rn.f16x2 c, c, k7, n7;
                    fma.rn.f16x2 d, d, k11, n11;
                    fma.rn.f16x2 acc, a, $13, acc;
                    fma.rn.f16x2 acc, b, $14, acc;
                    fma.rn.f16x2 acc, c, $15, acc;
                    fma.rn.f16x2 acc, d, $16, acc;
                    shr.u32 s, $4, 8;
                    lop3.b32 a, $4, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 b, $4, 0x00f000f0, 0x64806480, 0x6a;
                    lop3.b32 c, s, 0x000f000f, 0x64086408, 0x6a;
                    lop3.b32 d, s, 0x00f000f0, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k7, n7;
                    fma.rn.f16x2 b, b, k11, n11;
                    fma.rn.f16x2 c, c, k7, n7;
                    fma.rn.f16x2 d, d, k11, n11;
                    fma.rn.f16x2 acc, a, $17, acc;
                    fma.rn.f16x2 acc, b, $18, acc;
                    fma.rn.f16x2 acc, c, $19, acc;
                    fma.rn.f16x2 acc, d, $20, acc;
                    mov.b32 {lo, hi}, acc;
                    cvt.f32.f16 fl, lo;
                    cvt.f32.f16 fh, hi;
                    add.f32 fl, fl, fh;
                    mov.b32 $0, fl;
                    }""",
            "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        a0, a1, a2, a3 = _split4(xa)
        b0, b1, b2, b3 = _split4(xb)
        part = tl.inline_asm_elementwise(
            """{
                    .reg .b32 s, a, b, k10, n10, acc;
                    .reg .b16 lo, hi;
                    .reg .f32 fl, fh;
                    mov.b32 k10, 0x14001400;
                    mov.b32 n10, 0xbc80bc80;
                    shr.u32 s, $1, 8;
                    lop3.b32 a, $1, 0x00ff00ff, 0x64806480, 0x6a;
                    lop3.b32 b, s, 0x00ff00ff, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k10, n10;
                    fma.rn.f16x2 b, b, k10, n10;
                    mul.rn.f16x2 acc, a, $5;
                    fma.rn.f16x2 acc, b, $6, acc;
                    shr.u32 s, $2, 8;
                    lop3.b32 a, $2, 0x00ff00ff, 0x64806480, 0x6a;
                    lop3.b32 b, s, 0x00ff00ff, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k10, n10;
                    fma.rn.f16x2 b, b, k10, n10;
                    fma.rn.f16x2 acc, a, $7, acc;
                    fma.rn.f16x2 acc, b, $8, acc;
                    shr.u32 s, $3, 8;
                    lop3.b32 a, $3, 0x00ff00ff, 0x64806480, 0x6a;
                    lop3.b32 b, s, 0x00ff00ff, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k10, n10;
                    fma.rn.f16x2 b, b, k10, n10;
                    fma.rn.f16x2 acc, a, $9, acc;
                    fma.rn.f16x2 acc, b, $10, acc;
                    shr.u32 s, $4, 8;
                    lop3.b32 a, $4, 0x00ff00ff, 0x64806480, 0x6a;
                    lop3.b32 b, s, 0x00ff00ff, 0x64806480, 0x6a;
                    fma.rn.f16x2 a, a, k10, n10;
                    fma.rn.f16x2 b, b, k10, n10;
                    fma.rn.f16x2 acc, a, $11, acc;
                    fma.rn.f16x2 acc, b, $12, acc;
                    mov.b32 {lo, hi}, acc;
                    cvt.f32.f16 fl, lo;
                    cvt.f32.f16 fh, hi;
                    add.f32 fl, fl, fh;
                    mov.b32 $0, fl;
                    }""",
            "=r,r,r,r,r,r,r,r,r,r,r,r,r",
            [w0, w1, w2, w3, a0, b0, a1, b1, a2, b2, a3, b3],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    return part.to(tl.float32, bitcast=True)


@triton.jit
def _split_k_sum(acc, ws_ptr, counter, pid_k, pid_m, N, cols, col_ok, SPLIT_K: tl.constexpr):
    """Split-K's sum in a fixed order: this split leaves its fp32 sums ``acc`` (program row
    ``pid_m``, columns ``cols``) in its own slice of the workspace ``ws_ptr`` (as int32 bits:
    the CPU interpreter has no float exchange) and counts itself in ``counter``; the last split
    to arrive adds every slice in split order (the same bits whichever split finishes last),
    leaving the slices and the counter zero for the next launch. Returns (the sum over the
    splits, meaningful only to the last, and whether this program is the last). The other
    splits' sums are read with atomic exchanges: they are in L2, not in this SM's L1."""
    rows_m = tl.num_programs(0)
    ws_bits = ws_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    own = ws_bits + (pid_k * rows_m + pid_m).to(tl.int64) * N + cols
    tl.atomic_xchg(own, acc.to(tl.int32, bitcast=True), mask=col_ok, sem="relaxed")
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        zero_bits = tl.zeros_like(acc).to(tl.int32, bitcast=True)
        for k_part in tl.static_range(SPLIT_K):
            part = ws_bits + (k_part * rows_m + pid_m).to(tl.int64) * N + cols
            bits = tl.atomic_xchg(part, zero_bits, mask=col_ok, sem="relaxed")
            total += bits.to(tl.float32, bitcast=True)
        tl.atomic_xchg(counter, 0, sem="relaxed")
    return total, last


@triton.jit
def _fp32_step_sums(
    words,
    x_row,
    pairs,
    k0,
    g,
    jj,
    FORMAT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GPS: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    """One K step's products on the fp32 path (no f16x2): the packed ``words`` ``(BLOCK_N,
    GPS, 16)`` unpacked exactly to fp32 and multiplied by the activations at ``k0``, summed
    per word (the caller scales by the group's scale). Shared by :func:`gemv_kernel` and the
    fused decode GEMV."""
    x_type = x_row.dtype.element_ty
    PER: tl.constexpr = 8 if FORMAT == 1 else 4  # fields per word
    PACK: tl.constexpr = 16 * PER  # input features per packed block
    BITS: tl.constexpr = 32 // PER
    LOW: tl.constexpr = 20 // BITS  # fields 0 .. LOW-1 lie below mantissa bit 20 in place
    OFFSET: tl.constexpr = 8 if FORMAT == 1 else 128
    if FORMAT == 1:
        words = words ^ -2004318072  # 0x88888888: two's complement -> offset binary
    elif FORMAT == 0:
        words = words ^ -2139062144  # 0x80808080
    high = words >> (BITS * (PER - LOW))  # the upper fields, down to bits 0 ..
    t = tl.zeros((BLOCK_N, GPS, 16), dtype=tl.float32)
    for p in tl.static_range(PER // 2):
        # elements 32p + 2jj (+1) of each block: the int32 pair 16p + jj
        if x_type == tl.float32:
            base = x_row + k0 + g * PACK + 32 * p + 2 * jj
            x_lo = tl.load(base)
            x_hi = tl.load(base + 1)
        else:
            xp = tl.load(pairs + k0 // 2 + g * (PACK // 2) + 16 * p + jj)
            if x_type == tl.bfloat16:
                x_lo = (xp << 16).to(tl.float32, bitcast=True)
                x_hi = (xp & -65536).to(tl.float32, bitcast=True)
            else:
                x_lo = xp.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                x_hi = (xp >> 16).to(tl.int16).to(tl.float16, bitcast=True)
                x_hi = x_hi.to(tl.float32)
        for b in tl.static_range(2):
            f = 2 * p + b
            # the field at bit `at` of `src`, or-ed into the mantissa of 2^(23 - at): one
            # mantissa unit is 1.0 there, so the float is 2^(23 - at) + u exactly
            if FORMAT == 2:
                byte = (words >> (8 * f)) & 255
                if NATIVE_FP8:
                    fp8 = byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
                    value = fp8.to(tl.float32)
                else:  # the e4m3 byte as an fp16 pattern: the value times 2^-8
                    half = ((byte & 0x7F) << 7) | ((byte & 0x80) << 8)
                    value = half.to(tl.int16).to(tl.float16, bitcast=True)
                    value = value.to(tl.float32)
            else:
                at = BITS * f if f < LOW else BITS * (f - PER + LOW)
                src = words if f < LOW else high
                field = src & (((1 << BITS) - 1) << at)
                value = (field | ((150 - at) << 23)).to(tl.float32, bitcast=True)
                # - (2^(23 - at) + offset): the code itself, exactly (Sterbenz)
                value = value - ((1 << (23 - at)) + OFFSET)
            t += value * (x_lo if b == 0 else x_hi)
    return t


@triton.jit
def gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,  # FIXUP: fp32 (SPLIT_K, rows, N) partial sums, zero at rest
    count_ptr,  # FIXUP: int32 arrival counters, one per (row, column block), zero at rest
    N,
    K,
    stride_xm,
    stride_om,
    stride_cn,  # codes per output row: K // 8 (int4 words), K // 4 (int8 words), K (dense)
    FORMAT: tl.constexpr,  # 0 int8, 1 int4, 2 fp8 e4m3 (packed words), 3 dense (no scales)
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NATIVE_FP8: tl.constexpr = False,  # fp8: the hardware e4m3 conversion (sm_89+)
    FIXUP: tl.constexpr = False,  # split-K: the last split writes out (no zero-fill, no cast)
    HALF2: tl.constexpr = False,  # int4/int8, 16-bit x, NVIDIA: f16x2 unpack + multiply (asm)
    PREFETCH: tl.constexpr = False,  # codes and scales of step + 1 loaded before step's math
    QUADS: tl.constexpr = False,  # HALF2: one f16x2 sum per thread's four words (one group)
):
    """out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); one activation row per program."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols64 = cols.to(tl.int64)
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, steps)
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    x_type = x_ptr.dtype.element_ty
    if FORMAT == 3:
        j = tl.arange(0, BLOCK_K)[None, :]
        code_rows = codes_ptr + cols64[:, None] * stride_cn
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for step in range(first, last):
            k0 = step * BLOCK_K
            w = tl.load(code_rows + k0 + j, mask=col_ok[:, None], other=0.0).to(tl.float32)
            acc2 += w * tl.load(x_row + k0 + j).to(tl.float32)
        acc = tl.sum(acc2, axis=1)
    else:
        PER: tl.constexpr = 8 if FORMAT == 1 else 4  # fields per word
        PACK: tl.constexpr = 16 * PER  # input features per packed block
        GPS: tl.constexpr = BLOCK_K // PACK  # packed blocks per step
        g = tl.arange(0, GPS)[None, :, None]
        jj = tl.arange(0, 16)[None, None, :]
        word = g * 16 + jj  # (1, GPS, 16): word index within the step
        # Rows past N re-read row N - 1 (their sums are never stored), so no load is masked.
        safe_rows = tl.minimum(cols, N - 1).to(tl.int64)[:, None, None]
        code_rows = codes_ptr + safe_rows * stride_cn
        scale_rows = scales_ptr + safe_rows * (K // GROUP) + jj * 0  # in the words' shape
        pairs = x_row.to(tl.pointer_type(tl.int32), bitcast=True)
        acc3 = tl.zeros((BLOCK_N, GPS, 16), dtype=tl.float32)
        acc_quads = tl.zeros((BLOCK_N, GPS, 4), dtype=tl.float32)
        if PREFETCH:
            # step + 1 clamped to the split's last step (re-read once, from cache): no masks
            ahead = tl.minimum(first, steps - 1)
            next_words = tl.load(code_rows + ahead * (BLOCK_K // PER) + word)
            next_scale = tl.load(scale_rows + (ahead * BLOCK_K + g * PACK) // GROUP)
        for step in range(first, last):
            k0 = step * BLOCK_K
            if PREFETCH:
                words = next_words
                scale = next_scale
                ahead = tl.minimum(step + 1, last - 1)
                next_words = tl.load(code_rows + ahead * (BLOCK_K // PER) + word)
                next_scale = tl.load(scale_rows + (ahead * BLOCK_K + g * PACK) // GROUP)
            else:
                words = tl.load(code_rows + step * (BLOCK_K // PER) + word)
                scale = tl.load(scale_rows + (k0 + g * PACK) // GROUP)
            if HALF2 and QUADS:
                xpairs = pairs + k0 // 2 + g * (PACK // 2) + jj
                quad_scale, _s1, _s2, _s3 = _split4(scale)
                sums = _half2_quad_sums(words, xpairs, FORMAT, x_type == tl.bfloat16)
                acc_quads += sums * quad_scale.to(tl.float32)
            elif HALF2:
                xpairs = pairs + k0 // 2 + g * (PACK // 2) + jj
                sums = _half2_word_sums(words, xpairs, FORMAT, x_type == tl.bfloat16)
                acc3 += sums * scale.to(tl.float32)
            else:
                t = _fp32_step_sums(
                    words, x_row, pairs, k0, g, jj, FORMAT, BLOCK_N, GPS, NATIVE_FP8
                )
                acc3 += t * scale.to(tl.float32)
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
        if FORMAT == 2 and not NATIVE_FP8:
            acc = acc * 256.0
        if HALF2 and QUADS:  # the f16x2 weights are code / 128 (int4) or code / 1024 (int8)
            acc = tl.sum(tl.sum(acc_quads, axis=2), axis=1) * (128.0 if FORMAT == 1 else 1024.0)
        elif HALF2:  # the f16x2 weights are code / 32 (int4) or code / 256 (int8)
            acc = acc * (32.0 if FORMAT == 1 else 256.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)
    out_ptrs = out_ptr + pid_m.to(tl.int64) * stride_om + cols
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    elif FIXUP:
        # the splits' sums added in a fixed order by the last to arrive (_split_k_sum), which
        # writes the output in its dtype
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        total, last = _split_k_sum(acc, ws_ptr, counter, pid_k, pid_m, N, cols, col_ok, SPLIT_K)
        if last:
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=col_ok)
    else:
        tl.atomic_add(out_ptrs, acc, mask=col_ok)


@triton.jit
def dequantize_packed_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    N,
    K,
    FORMAT: tl.constexpr,  # 0 int8, 1 int4, 2 fp8 e4m3
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out[n, k] = code[n, k] * scale[n, k // GROUP] from the packed words, one packed block
    per program column; fp32 product, rounded once to out's dtype."""
    PER: tl.constexpr = 8 if FORMAT == 1 else 4
    BITS: tl.constexpr = 32 // PER
    PACK: tl.constexpr = 16 * PER
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    block = tl.program_id(1)
    col_ok = cols < N
    rows64 = cols.to(tl.int64)[:, None]
    # element e of the block is field 2 (e // 32) + e % 2 of word (e % 32) // 2: gather each
    # element's word (cached: eight elements share one), store the tile contiguously
    e = tl.arange(0, PACK)[None, :]
    word = (e % 32) // 2
    shift = BITS * (2 * (e // 32) + e % 2)
    words = tl.load(
        codes_ptr + rows64 * (K // PER) + block * 16 + word, mask=col_ok[:, None], other=0
    )
    field = (words >> shift) & ((1 << BITS) - 1)
    if FORMAT == 2:
        half = ((field & 0x7F) << 7) | ((field & 0x80) << 8)  # e4m3 as fp16 bits: x 2^-8
        value = half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        value = ((field ^ (1 << (BITS - 1))) - (1 << (BITS - 1))).to(tl.float32)  # sign-extend
    scale = tl.load(
        scales_ptr + rows64 * (K // GROUP) + (block * PACK) // GROUP,
        mask=col_ok[:, None],
        other=0.0,
    )
    tl.store(
        out_ptr + rows64 * K + block * PACK + e,
        (value * scale.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=col_ok[:, None],
    )


def dequantize_packed(
    words: torch.Tensor,
    scales: torch.Tensor,
    format: str,
    group_size: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``(out, in)`` weight in ``dtype`` from :func:`pack_gemv`'s words (prefill's path)."""
    check_packable(format, group_size, in_features)
    out_features = words.numel() * PER_WORD[format] // in_features
    out = torch.empty(out_features, in_features, device=words.device, dtype=dtype)
    grid = (triton.cdiv(out_features, 16), in_features // pack_block(format))
    dequantize_packed_kernel[grid](
        words,
        scales,
        out,
        out_features,
        in_features,
        FORMAT=GEMV_FORMAT_CODES[format],
        GROUP=group_size,
        BLOCK_N=16,
    )
    return out


# Per-shape choices from the sweep (tools/bench/quant_gemv_bench.py --sweep --rows 1, one H100,
# Llama-3-8B shapes incl. the LM head, 2026-11-26), keyed by (format, out_features, in_features);
# one table for every GPU (half2 only takes effect on NVIDIA: AMD and the CPU interpreter run the
# same tiles on the fp32 path). Shapes not listed take gemv_default_config's heuristic, which
# follows these winners. Fraction of the copy bandwidth reached (codes + scales + activations):
# int4 qkv 0.57, o 0.46, gate_up 0.81, down 0.72, lm_head 0.99; int8 0.74 / 0.67 / 0.95 / 0.85 /
# 1.04 (was int4 0.34 / 0.29 / 0.40 / 0.39 / 0.46 with the fp32 unpacking).
_HPQ = {"half2": True, "prefetch": True, "quads": True}
GEMV_TABLE: dict[tuple[str, int, int], GemvConfig] = {
    ("int4", 6144, 4096): GemvConfig(block_n=4, num_warps=1, **_HPQ),
    ("int4", 4096, 4096): GemvConfig(block_n=4, num_warps=1, **_HPQ),
    ("int4", 28672, 4096): GemvConfig(block_n=8, num_warps=1, half2=True, quads=True),
    ("int4", 4096, 14336): GemvConfig(block_n=4, num_warps=2, **_HPQ),
    ("int4", 128256, 4096): GemvConfig(block_n=4, num_warps=1, half2=True, quads=True),
    ("int8", 6144, 4096): GemvConfig(block_n=4, num_warps=2, **_HPQ),
    ("int8", 4096, 4096): GemvConfig(block_n=4, num_warps=2, **_HPQ),
    ("int8", 28672, 4096): GemvConfig(block_n=4, num_warps=1, **_HPQ),
    ("int8", 4096, 14336): GemvConfig(block_n=4, num_warps=2, **_HPQ),
    ("int8", 128256, 4096): GemvConfig(block_n=4, num_warps=4, half2=True, quads=True),
}


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def gemv_default_config(
    format: str, out_features: int, in_features: int, group_size: int, device: torch.device
) -> GemvConfig | None:
    """The launch for one shape (None: the kernel cannot run it).

    The table's entry if any; else 4 output rows per program (the sweep's winner for almost
    every format and shape), and for int4/int8 the f16x2 unpacking with quads and prefetch (every
    int4/int8 winner's), with one warp (int4 at K <= 8192, int8 at N >= 16384; else two, as the
    winners), or for fp8/dense the most warps (up to 2) whose step divides K; split-K only while
    there are fewer than 4 programs per SM.
    """
    chosen = GEMV_TABLE.get((format, out_features, in_features))
    if chosen is not None and gemv_supports(format, group_size, in_features, chosen):
        return chosen
    integer = format in ("int4", "int8")
    order: tuple[int, ...] = (2, 1)
    if (format == "int4" and in_features <= 8192) or (format == "int8" and out_features >= 16384):
        order = (1, 2)
    for warps in order:
        config = GemvConfig(4, warps, half2=integer, prefetch=integer, quads=integer)
        if gemv_supports(format, group_size, in_features, config):
            break
    else:
        return None
    programs = triton.cdiv(out_features, config.block_n)
    steps = in_features // gemv_block_k(format, warps)
    split = 1
    while split < 8 and programs * split < 4 * _multiprocessors(device) and steps >= 2 * split:
        split *= 2
    return dataclasses.replace(config, split_k=split)


def launch_gemv(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor | None,
    format: str,
    group_size: int,
    bias: torch.Tensor | None,
    config: GemvConfig,
) -> torch.Tensor:
    """Run :func:`gemv_kernel`: ``format`` ``"int8"``/``"int4"`` (``codes`` from
    :func:`pack_gemv`, ``scales`` from ``quantize``) or ``"dense"`` (``codes`` the ``(out, in)``
    weight in ``x.dtype``, ``scales`` None). One program per activation row: for a few rows."""
    in_features = x.shape[-1]
    if format == "dense":
        out_features = codes.shape[0]
        group_size = gemv_block_k(format, config.num_warps)
    else:
        assert scales is not None
        check_packable(format, group_size, in_features)
        out_features = codes.numel() * PER_WORD[format] // in_features
        if codes.dtype != torch.int32:
            raise ValueError(f"launch_gemv: {format} codes must be pack_gemv's int32 words")
        check_weight(
            codes.view(torch.uint8) if format == "int4" else codes.view(torch.int8),
            scales,
            format,
            group_size,
            in_features,
        )
    if not gemv_supports(format, group_size, in_features, config):
        raise ValueError(
            f"launch_gemv: {config} cannot run {format} with in_features={in_features}, "
            f"group_size={group_size} (in_features must be a multiple of "
            f"{gemv_block_k(format, config.num_warps)})"
        )
    flat = x.reshape(-1, in_features)
    if flat.stride(-1) != 1 or flat.stride(0) % 2 or flat.data_ptr() % 4:
        flat = flat.clone(memory_format=torch.contiguous_format)  # activation pairs: int32
    rows = flat.shape[0]
    split = config.split_k
    blocks = triton.cdiv(out_features, config.block_n)
    scratch = (
        _fixup_scratch(x.device, split * rows * out_features, rows * blocks, on_cpu=True)
        if split > 1
        else None
    )
    out = (
        torch.empty(rows, out_features, device=x.device, dtype=x.dtype)
        if split == 1 or scratch is not None
        else torch.zeros(rows, out_features, device=x.device, dtype=torch.float32)
    )
    grid = (rows, blocks, split)
    gemv_kernel[grid](
        flat,
        codes,
        scales if scales is not None else codes,
        bias if bias is not None else flat,
        out,
        scratch[0] if scratch is not None else out,
        scratch[1] if scratch is not None else out,
        out_features,
        in_features,
        flat.stride(0),
        out.stride(0),
        codes.stride(0) if codes.dim() == 2 else in_features // PER_WORD.get(format, 1),
        FORMAT=GEMV_FORMAT_CODES[format],
        GROUP=group_size,
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        BLOCK_K=gemv_block_k(format, config.num_warps),
        SPLIT_K=split,
        NATIVE_FP8=format == "fp8_e4m3" and _native_fp8(x.device),
        FIXUP=scratch is not None,
        HALF2=config.half2 and half2_supported(format, x),
        PREFETCH=config.prefetch and format != "dense",
        QUADS=config.quads,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


# Split-K scratch per (device, stream): an fp32 workspace (a slice per split) and arrival
# counters that the kernel leaves zeroed, so a split GEMV needs no zero-fill or cast launches
# (a CUDA graph replays them).
_SCRATCH: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}
FIXUP_SPLIT_K = True  # False: split-K sums with atomics into a zeroed fp32 output, then casts


def _fixup_scratch(
    device: torch.device, values: int, counters: int, on_cpu: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The zeroed workspace and counters for a split, grown outside CUDA-graph capture only
    (None while capturing without a large enough one: the zero-fill path runs instead).
    ``on_cpu``: also on the CPU (the interpreter; :func:`gemv_kernel`'s fixup exchanges int32
    bits, which it runs, but ``decode_gemv``'s float exchange it does not)."""
    if not FIXUP_SPLIT_K:
        return None
    # (the CPU interpreter runs the programs one after another: the last split is the last
    # program, and the sum's order is the splits' either way)
    cuda = device.type == "cuda"
    if not cuda and not on_cpu:
        return None
    key = (device, torch.cuda.current_stream(device).stream_id if cuda else 0)
    held = _SCRATCH.get(key)
    if held is not None and held[0].numel() >= values and held[1].numel() >= counters:
        return held
    if cuda and torch.cuda.is_current_stream_capturing():
        return None
    size = max(values, 1 << 20)
    held = (
        torch.zeros(size, device=device, dtype=torch.float32),
        torch.zeros(max(counters, 1 << 16), device=device, dtype=torch.int32),
    )
    _SCRATCH[key] = held
    return held


def half2_supported(format: str, x: torch.Tensor) -> bool:
    """Whether ``GemvConfig.half2`` takes effect: int4/int8 codes, bf16/fp16 activations, an
    NVIDIA GPU (the f16x2 unpacking is PTX); elsewhere the fp32 path runs (same results within
    the 16-bit output's rounding)."""
    return (
        format in ("int4", "int8")
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.device.type == "cuda"
        and torch.version.hip is None
        and not interpreting()
    )


def _native_fp8(device: torch.device) -> bool:
    """NVIDIA sm_89+ converts e4m3 in hardware (ROCm's native fp8 is another variant)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def aot_specs() -> list[AotSpec]:
    """The gemv specialisations ``slipstream.kernels.aot`` compiles for every GPU target."""
    specs = []
    for dtype in ("bf16", "fp16"):
        for format, code in GEMV_FORMAT_CODES.items():
            for split, warps in ((1, 1), (4, 2)):
                block_k = gemv_block_k(format, warps)
                dense = format == "dense"
                specs.append(
                    AotSpec(
                        f"quant_matmul.gemv[{format}x{dtype},w{warps}s{split}]",
                        gemv_kernel,
                        {
                            "x_ptr": f"*{dtype}",
                            "codes_ptr": f"*{dtype}" if dense else "*i32",
                            "scales_ptr": f"*{dtype}" if dense else "*fp32",
                            "bias_ptr": f"*{dtype}",
                            "out_ptr": f"*{dtype}",  # split 4: the fixup writes it
                            "ws_ptr": "*fp32",
                            "count_ptr": "*i32",
                            "N": "i32",
                            "K": "i32",
                            "stride_xm": "i32",
                            "stride_om": "i32",
                            "stride_cn": "i32",
                            "FORMAT": "constexpr",
                            "GROUP": "constexpr",
                            "HAS_BIAS": "constexpr",
                            "BLOCK_N": "constexpr",
                            "BLOCK_K": "constexpr",
                            "SPLIT_K": "constexpr",
                            "NATIVE_FP8": "constexpr",
                            "FIXUP": "constexpr",
                            "HALF2": "constexpr",
                            "PREFETCH": "constexpr",
                            "QUADS": "constexpr",
                        },
                        {
                            "FORMAT": code,
                            "GROUP": block_k if dense else 128,
                            "HAS_BIAS": split == 1,
                            "BLOCK_N": 8,
                            "BLOCK_K": block_k,
                            "SPLIT_K": split,
                            "NATIVE_FP8": False,
                            "FIXUP": split > 1,
                            # the PTX half2 path is NVIDIA-only: built in every target's
                            # portable form here (kernels/tests: the half2 build for sm_80/90)
                            "HALF2": False,
                            "PREFETCH": split == 1 and not dense,
                            "QUADS": False,
                        },
                    )
                )
        for format in ("int8", "int4", "fp8_e4m3"):
            specs.append(
                AotSpec(
                    f"quant_matmul.dequantize_packed[{format}->{dtype}]",
                    dequantize_packed_kernel,
                    {
                        "codes_ptr": "*i32",
                        "scales_ptr": "*fp32",
                        "out_ptr": f"*{dtype}",
                        "N": "i32",
                        "K": "i32",
                        "FORMAT": "constexpr",
                        "GROUP": "constexpr",
                        "BLOCK_N": "constexpr",
                    },
                    {"FORMAT": GEMV_FORMAT_CODES[format], "GROUP": 128, "BLOCK_N": 32},
                )
            )
    return specs
