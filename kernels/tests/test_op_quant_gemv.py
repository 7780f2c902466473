"""The decode GEMV's packed int4 / int8 / fp8 layout and kernel: packing round trips and puts each
element where the layout says, ``quant_matmul_packed`` equals ``quant_matmul`` on the unpacked
codes, and the Triton kernels (gemv, dequantize_packed) match the reference for one and several
rows, 1 and 2 warps, split-K, bias, fp32 and fp16 activations (bf16 on the GPU only: the CPU
interpreter has no bf16 bit tricks worth testing there), and dense weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import quantize
from slipstream.kernels.ops.quant_matmul import (
    is_packable,
    pack_gemv,
    quant_matmul,
    quant_matmul_packed,
    unpack_gemv,
)
from slipstream.kernels.ops.quant_matmul.reference import dequantize_weight

_SEED = torch.Generator().manual_seed


def _weight(fmt: str, out_features: int, in_features: int, group: int):
    w = torch.randn(out_features, in_features, generator=_SEED(3))
    q = quantize(w, fmt, group)
    return q.data.reshape(out_features, -1), q.scales


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8_e4m3"])
def test_pack_round_trip_and_layout(fmt: str) -> None:
    per, bits = (8, 4) if fmt == "int4" else (4, 8)
    block = 16 * per
    codes, scales = _weight(fmt, 6, 2 * block, block)
    words = pack_gemv(codes, fmt, block, 2 * block)
    assert words.dtype == torch.int32 and words.shape == (6, 2 * block // per)
    unpacked = unpack_gemv(words, fmt, 2 * block)
    assert unpacked.dtype == codes.dtype
    assert torch.equal(unpacked.view(torch.uint8), codes.view(torch.uint8))
    if fmt == "fp8_e4m3":
        return
    # element 32p + 2jj + b of block B is field 2p + b of word 16B + jj (two's complement)
    values = dequantize_weight(codes, torch.ones_like(scales), fmt, block, 2 * block, torch.float32)
    wide = words.to(torch.int64) & 0xFFFFFFFF
    for row, blk, p, jj, b in ((0, 0, 0, 0, 0), (5, 1, per // 2 - 1, 15, 1), (3, 1, 1, 7, 0)):
        field = 2 * p + b
        raw = int(wide[row, 16 * blk + jj]) >> (bits * field) & ((1 << bits) - 1)
        signed = raw - (1 << bits) if raw >= 1 << (bits - 1) else raw
        assert signed == values[row, blk * block + 32 * p + 2 * jj + b]


def test_pack_refuses_shapes_it_cannot_hold() -> None:
    codes, _ = _weight("int4", 4, 256, 64)
    assert not is_packable("int4", 64, 256) and is_packable("int4", 128, 256)
    assert is_packable("fp8_e4m3", 64, 256) and not is_packable("fp8_e4m3", 32, 256)
    with pytest.raises(ValueError, match="multiples of 128"):
        pack_gemv(codes, "int4", 64, 256)
    with pytest.raises(ValueError, match="int8, int4 or fp8_e4m3"):
        pack_gemv(codes, "int2", 128, 256)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8_e4m3"])
def test_packed_op_equals_quant_matmul(fmt: str) -> None:
    codes, scales = _weight(fmt, 24, 256, 128)
    words = pack_gemv(codes, fmt, 128, 256)
    x, bias = torch.randn(3, 256, generator=_SEED(4)), torch.randn(24, generator=_SEED(5))
    torch.testing.assert_close(
        quant_matmul_packed(x, words, scales, fmt, 128, bias),
        quant_matmul(x, codes, scales, fmt, 128, bias),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8_e4m3"])
def test_gemv_kernel_matches_reference(triton_device: torch.device, fmt: str) -> None:
    from slipstream.kernels.ops.quant_matmul.gemv import (
        GemvConfig,
        dequantize_packed,
        gemv_block_k,
        launch_gemv,
    )

    in_features = gemv_block_k(fmt, 2)  # one 2-warp step, two 1-warp steps
    codes, scales = _weight(fmt, 24, in_features, 128)
    words = pack_gemv(codes, fmt, 128, in_features).to(triton_device)
    codes, scales = codes.to(triton_device), scales.to(triton_device)
    weight = dequantize_weight(codes, scales, fmt, 128, in_features, torch.float32)
    cases = [
        (1, torch.float32, GemvConfig(block_n=8, num_warps=1), True),
        (3, torch.float16, GemvConfig(block_n=16, num_warps=2), False),
        (2, torch.float16, GemvConfig(block_n=8, num_warps=1, split_k=2), True),
        # the register prefetch of the next step: two steps per split, and a lone step
        (1, torch.float16, GemvConfig(block_n=4, num_warps=1, prefetch=True), False),
        (1, torch.float32, GemvConfig(block_n=4, num_warps=1, split_k=2, prefetch=True), True),
    ]
    if triton_device.type == "cuda":
        cases.append((1, torch.bfloat16, GemvConfig(block_n=8, num_warps=2, split_k=2), True))
        # NVIDIA: f16x2 unpacking (int4/int8; fp8 ignores half2), with and without prefetch
        for dtype in (torch.bfloat16, torch.float16):
            cases.append((1, dtype, GemvConfig(block_n=4, half2=True, prefetch=True), True))
            cases.append((2, dtype, GemvConfig(block_n=8, num_warps=2, half2=True), False))
            cases.append((1, dtype, GemvConfig(block_n=4, split_k=2, half2=True), False))
            quads = GemvConfig(block_n=8, half2=True, prefetch=True, quads=True)
            cases.append((1, dtype, quads, True))
            cases.append(
                (3, dtype, GemvConfig(block_n=4, num_warps=2, half2=True, quads=True), False)
            )
    for rows, dtype, config, with_bias in cases:
        x = torch.randn(rows, in_features, generator=_SEED(6)).to(triton_device, dtype)
        bias = torch.randn(24, generator=_SEED(7)).to(triton_device, dtype) if with_bias else None
        out = launch_gemv(x, words, scales, fmt, 128, bias, config)
        expected = F.linear(x.float(), weight, None if bias is None else bias.float())
        assert out.dtype == dtype and out.shape == (rows, 24)
        # fp32: exact products summed in another order; 16-bit: one rounding of the fp32 sum.
        tol = 2e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * 8)
        # split-K leaves its workspace and counters zeroed and adds the splits in a fixed
        # order: a second call gives the same bits
        again = launch_gemv(x, words, scales, fmt, 128, bias, config)
        torch.testing.assert_close(again, out, rtol=0, atol=0)
    for dtype in (torch.float32, torch.float16):  # prefill's dequantization: bit-exact
        torch.testing.assert_close(
            dequantize_packed(words, scales, fmt, 128, in_features, dtype),
            dequantize_weight(codes, scales, fmt, 128, in_features, dtype),
            rtol=0,
            atol=0,
        )
    with pytest.raises(ValueError, match="must be a multiple of"):  # a 4-warp step is 2x K
        launch_gemv(x, words, scales, fmt, 128, None, GemvConfig(num_warps=4))


def test_packed_op_dispatch_and_dense_gemv(triton_device: torch.device) -> None:
    from slipstream.kernels.ops.quant_matmul import triton as backend
    from slipstream.kernels.ops.quant_matmul.gemv import (
        GemvConfig,
        gemv_default_config,
        launch_gemv,
    )

    codes, scales = _weight("int4", 40, 1024, 128)
    words = pack_gemv(codes, "int4", 128, 1024).to(triton_device)
    codes, scales = codes.to(triton_device), scales.to(triton_device)
    for rows in (1, backend.GEMV_MAX_ROWS + 1):  # the gemv kernel; dequantize + matmul
        x = torch.randn(rows, 1024, generator=_SEED(8)).to(triton_device, torch.float16)
        torch.testing.assert_close(
            backend.quant_matmul_packed(x, words, scales, "int4", 128).float(),
            quant_matmul(x.float(), codes, scales, "int4", 128),
            rtol=8e-3,
            atol=6e-2,
        )
    cpu = torch.device("cpu")
    hpq = {"half2": True, "prefetch": True, "quads": True}  # every int4/int8 sweep winner's
    wide = gemv_default_config("int4", 4096, 8192, 128, cpu)  # 1024 programs >= 4 per "SM"
    assert wide == GemvConfig(block_n=4, num_warps=1, split_k=1, **hpq)
    deep = gemv_default_config("int4", 4096, 16384, 128, cpu)  # long K: two warps (as down's)
    assert deep == GemvConfig(block_n=4, num_warps=2, split_k=1, **hpq)
    narrow = gemv_default_config("int8", 64, 2048, 128, cpu)  # 16 programs, 2 K steps
    assert narrow is not None and narrow.split_k == 2  # split K, never more than its steps
    table = gemv_default_config("int4", 6144, 4096, 128, cpu)  # the sweep's table entry
    assert table == GemvConfig(block_n=4, num_warps=1, **hpq)
    fp8 = gemv_default_config("fp8_e4m3", 4096, 8192, 128, cpu)  # half2 is int4/int8 only
    assert fp8 == GemvConfig(block_n=4, num_warps=2)
    assert gemv_default_config("int4", 64, 4096, 64, cpu) is None  # group not a packed block
    assert gemv_default_config("int4", 64, 1536, 128, cpu) is None  # K not a step multiple
    # dense weights through the same kernel (dense_gemv's one-row path)
    weight = torch.randn(40, 512, generator=_SEED(9)).to(triton_device, torch.float16)
    x = torch.randn(2, 512, generator=_SEED(10)).to(triton_device, torch.float16)
    out = launch_gemv(x, weight, None, "dense", 0, None, GemvConfig(block_n=16, num_warps=2))
    torch.testing.assert_close(
        out.float(), F.linear(x.float(), weight.float()), rtol=8e-3, atol=3e-2
    )


def test_half2_falls_back_to_the_fp32_path_off_nvidia(triton_device: torch.device) -> None:
    """``half2`` is PTX: on the CPU interpreter (and AMD) the kernel runs the fp32 path, so a
    half2 launch there returns exactly what the plain launch does."""
    from slipstream.kernels.ops.quant_matmul.gemv import GemvConfig, half2_supported, launch_gemv

    codes, scales = _weight("int4", 8, 1024, 128)
    words = pack_gemv(codes, "int4", 128, 1024).to(triton_device)
    x = torch.randn(1, 1024, generator=_SEED(8)).to(triton_device, torch.float16)
    assert not half2_supported("int4", x.float()) and not half2_supported("fp8_e4m3", x)
    if triton_device.type == "cuda":
        pytest.skip("the half2 path itself runs on this GPU (test_gemv_kernel_matches_reference)")
    assert not half2_supported("int4", x)
    scales = scales.to(triton_device)
    plain = launch_gemv(x, words, scales, "int4", 128, None, GemvConfig(block_n=4))
    half2 = launch_gemv(x, words, scales, "int4", 128, None, GemvConfig(block_n=4, half2=True))
    torch.testing.assert_close(half2, plain, rtol=0, atol=0)


_HALF2_BUILD = """
from slipstream.kernels.aot import compile_spec
from slipstream.kernels.ops.quant_matmul.gemv import aot_specs, gemv_block_k
from slipstream.kernels.triton_support import AotSpec

for fmt in ("int4", "int8"):
    base = next(s for s in aot_specs() if s.name.startswith(f"quant_matmul.gemv[{fmt}xbf16,w1s1"))
    signature = {**base.signature, "HALF2": "constexpr", "PREFETCH": "constexpr", "QUADS": "constexpr"}
    for target, half2 in (("sm_90", True), ("sm_80", True), ("gfx942", False)):
        constexprs = {**base.constexprs, "BLOCK_K": gemv_block_k(fmt, 1), "BLOCK_N": 4}
        constexprs.update(HALF2=half2, PREFETCH=True, QUADS=half2)
        spec = AotSpec(f"gemv[{fmt},half2={half2}]", base.kernel, signature, constexprs)
        result = compile_spec(spec, target)
        print(fmt, target, result.ok, result.error)
"""


@pytest.mark.aot
def test_half2_gemv_builds_for_nvidia_and_prefetch_for_amd(tmp_path) -> None:
    """The f16x2 inline PTX assembles (ptxas) for sm_80 and sm_90; the portable prefetch path
    builds for MI300 (gfx942), where half2 is never set."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="the AOT builds need `pip install triton`")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    done = subprocess.run(
        [sys.executable, "-c", _HALF2_BUILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 6 and all(line.split()[2] == "True" for line in lines), done.stdout
