"""``quant_decode_gemv``: the packed int4 / int8 / fp8 decode GEMV with the norm prologue, the
SiLU * up epilogue and the residual add + norm epilogue. The reference equals the unfused ops it
replaces (add_rms_norm, quant_matmul_packed, gated_activation) within bf16 rounding; the Triton
kernel equals the reference (CPU interpreter: fp32 / fp16; GPU with ``-m gpu``: bf16 and the
f16x2 path too)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from slipstream.kernels.ops import add_rms_norm, gated_activation, quantize
from slipstream.kernels.ops.quant_matmul import pack_gemv, quant_decode_gemv, quant_matmul_packed
from slipstream.kernels.ops.quant_matmul.reference import quant_decode_gemv as reference

_SEED = torch.Generator().manual_seed
_IN = {"int4": 2048, "int8": 2048, "fp8_e4m3": 2048}  # two steps of the packed loop


def _packed(fmt: str, out_features: int, in_features: int, seed: int = 3):
    w = torch.randn(out_features, in_features, generator=_SEED(seed))
    q = quantize(w, fmt, 128)
    words = pack_gemv(q.data.reshape(out_features, -1), fmt, 128, in_features)
    return words, q.scales.reshape(out_features, -1)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_reference_is_the_unfused_ops(fmt: str) -> None:
    """x + residual -> RMSNorm -> GEMV -> SiLU * up, as the fused chain computes it: the norm's
    1/rms applied after the GEMV (its rounding moved), the rest rounded as the unfused ops."""
    hidden, inter = 256, 128
    up_words, up_scales = _packed(fmt, 2 * inter, hidden)
    out_words, out_scales = _packed(fmt, hidden, hidden, seed=4)
    dtype = torch.bfloat16
    x = torch.randn(1, hidden, generator=_SEED(1)).to(dtype)
    attn = torch.randn(1, hidden, generator=_SEED(2)).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=_SEED(5))).to(dtype)
    # unfused: o_proj, add + RMSNorm, gate/up, SiLU * up
    pending = quant_matmul_packed(attn, out_words, out_scales, fmt, 128)
    total, h = add_rms_norm(pending, x, norm_weight, 1e-5)
    expected = gated_activation(quant_matmul_packed(h, up_words, up_scales, fmt, 128), "silu")
    # fused: o_proj with the add + norm-weight epilogue, gate/up with the 1/rms and SiLU * up
    u, fused_total, stats = reference(
        attn, out_words, out_scales, fmt, 128, residual=x, norm_weight=norm_weight
    )
    assert fused_total is not None and stats is not None
    # (the CPU's unfused GEMV rounds the dequantized weight to bf16 first: an ulp apart)
    ulp = total.float().abs().max().item() / 128
    torch.testing.assert_close(fused_total, total, rtol=0, atol=ulp)
    sums = total.float().pow(2).sum(-1)
    torch.testing.assert_close(stats.sum(-1), sums, rtol=0.01, atol=0)
    out, none, _ = reference(u, up_words, up_scales, fmt, 128, stats=stats, eps=1e-5, gated=True)
    assert none is None and out.shape == expected.shape
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=0.02, atol=0.02 * scale)
    # the op on the CPU is the reference
    again = quant_decode_gemv(u, up_words, up_scales, fmt, 128, None, stats, 1e-5, True)[0]
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8_e4m3"])
def test_kernel_matches_reference(
    triton_device: torch.device, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.kernels.ops.quant_matmul import fused_gemv

    # On a GPU also with programmatic dependent launch (and the L2 prefetch: a small weight);
    # NVIDIA sm_90+ only, a no-op elsewhere.
    for pdl in ("off", "on", "l2_partial") if triton_device.type == "cuda" else ("off",):
        _kernel_matches_reference(triton_device, fmt, pdl=pdl)
    # a persistent grid (an LM head's): two programs walk the blocks
    monkeypatch.setattr(
        fused_gemv, "_grid_programs", lambda blocks, device, per_sm=0: min(blocks, 2)
    )
    _kernel_matches_reference(triton_device, fmt)


def test_split_k_and_persistent_launches(triton_device: torch.device) -> None:
    """Launch-table knobs: K cut in two or three ranges (the last to finish adds the ranges'
    sums in range order and runs the epilogue, leaving the workspace zero for the next launch;
    a second launch gives the same bits), a persistent grid of one program per SM walking two
    blocks each, and the two-step loop (one step too many or not) equal the reference (fp32 on
    the CPU)."""
    from slipstream.kernels.ops.quant_matmul import fused_gemv
    from slipstream.kernels.ops.quant_matmul.fused_table import FusedGemvConfig

    split = FusedGemvConfig(block_n=4, split_k=2, half2=True, prefetch=True, two_step=True)
    persistent = FusedGemvConfig(block_n=2, split_k=2, prefetch=False, programs_per_sm=1)
    two_step = FusedGemvConfig(block_n=2, programs_per_sm=1, two_step=True)
    for config in (split, split, persistent, two_step):  # twice: the workspace was left zero
        _kernel_matches_reference(triton_device, "int4", config, quick=True)
    # an odd number of K steps (three: the two-step loop's last half is skipped), alone and
    # cut in two ranges (two steps and one)
    words, scales = _packed("int4", 8, 3072)
    words, scales = words.to(triton_device), scales.to(triton_device)
    x = torch.randn(1, 3072, generator=_SEED(9)).to(triton_device)
    want = reference(x, words, scales, "int4", 128)[0]
    for config in (
        FusedGemvConfig(block_n=4),
        FusedGemvConfig(block_n=4, two_step=True),
        FusedGemvConfig(block_n=4, split_k=2, two_step=True),
        FusedGemvConfig(block_n=4, split_k=3),  # one step each: the splits' order matters
    ):
        got = fused_gemv.fused_quant_gemv(x, words, scales, "int4", 128, config=config)[0]
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
        # the splits' sums are added in split order, whichever finishes last: the same bits
        again = fused_gemv.fused_quant_gemv(x, words, scales, "int4", 128, config=config)[0]
        torch.testing.assert_close(again, got, rtol=0, atol=0)
    # (the scratch is keyed by the tensors' device, cuda:0, not the fixture's bare "cuda")
    held = [t for key, t in fused_gemv._SCRATCH.items() if key[0].type == triton_device.type]
    assert held and all(t.count_nonzero() == 0 for pair in held for t in pair)
    with pytest.raises(ValueError, match="split_k"):
        _kernel_matches_reference(triton_device, "int4", FusedGemvConfig(split_k=64), quick=True)


def _kernel_matches_reference(
    triton_device: torch.device,
    fmt: str,
    config: object | None = None,
    quick: bool = False,
    pdl: str = "on",
) -> None:
    """``quick``: fp32 (and bf16 on a GPU) and three of the fusions only."""
    from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_quant_gemv

    in_features, out_features = _IN[fmt], 24
    words, scales = _packed(fmt, out_features, in_features)
    words, scales = words.to(triton_device), scales.to(triton_device)
    dtypes = [torch.float32] if quick else [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)  # and the f16x2 path (int4 / int8 on NVIDIA)
    for dtype in dtypes:
        gen = _SEED(6)

        def rand(
            *shape: int, dtype: torch.dtype = dtype, gen: torch.Generator = gen
        ) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(triton_device, dtype)

        x = rand(1, in_features)
        # the norm's input as a residual stream far from 1: rms ~ 100 (x then is total * w)
        parts = rand(1, 7, dtype=torch.float32).abs() + 0.5
        stats = parts / parts.sum() * in_features * 1e4
        big = 100 * x
        cases: list[dict] = [
            {},
            {"bias": rand(out_features)},
            {"stats": stats, "eps": 1e-6, "x": big},
            {"gated": True},
            {"stats": stats, "eps": 1e-6, "gated": True, "bias": rand(out_features), "x": big},
            {"residual": rand(1, out_features), "norm_weight": rand(out_features)},
        ]
        for kwargs in [cases[0], cases[4], cases[5]] if quick else cases:
            row = kwargs.pop("x", x)
            got = fused_quant_gemv(row, words, scales, fmt, 128, **kwargs, config=config, pdl=pdl)
            want = reference(row, words, scales, fmt, 128, **kwargs)
            for a, b in zip(got[:2], want[:2], strict=True):
                assert (a is None) == (b is None)
                if a is None or b is None:
                    continue
                assert a.shape == b.shape and a.dtype == b.dtype
                # one rounding of the same fp32 sum (16-bit: a unit in the last place)
                scale = b.float().abs().max().item()
                tol = 2e-5 if dtype == torch.float32 else 1e-2
                torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale)
            if "residual" in kwargs:  # per-program partial sums: the same total
                assert got[2] is not None and want[2] is not None
                torch.testing.assert_close(
                    got[2].sum(-1),
                    want[2].sum(-1),
                    rtol=2e-2 if dtype != torch.float32 else 1e-5,
                    atol=0,
                )
    # more rows than a decode step: the reference
    many = torch.randn(6, in_features).to(triton_device, torch.float32)
    torch.testing.assert_close(
        fused_quant_gemv(many, words, scales, fmt, 128)[0],
        reference(many, words, scales, fmt, 128)[0],
    )
    with pytest.raises(ValueError, match="norm_weight"):
        fused_quant_gemv(x, words, scales, fmt, 128, residual=x[:, :out_features])
    with pytest.raises(ValueError, match="pdl = 'sometimes'"):
        fused_quant_gemv(x, words, scales, fmt, 128, pdl="sometimes")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_qkv_with_rotary_and_cache_write(
    triton_device: torch.device, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quant_decode_qkv: the QKV GEMV (norm 1/rms from stats) then rotary_kv_write, in one
    kernel: queries, the rotated key and the value at the slot equal the reference's."""
    from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_quant_qkv
    from slipstream.kernels.ops.quant_matmul.reference import quant_decode_qkv

    heads, kv_heads, head_dim, slots = 4, 2, 16, 8
    in_features = _IN[fmt]
    words, scales = _packed(fmt, (heads + 2 * kv_heads) * head_dim, in_features)
    words, scales = words.to(triton_device), scales.to(triton_device)
    dtypes = [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)
    gen = _SEED(8)
    for dtype in dtypes:
        if dtype == torch.float16:  # and a persistent grid: two programs walk the blocks
            fused_gemv = importlib.import_module("slipstream.kernels.ops.quant_matmul.fused_gemv")
            monkeypatch.setattr(fused_gemv, "_grid_programs", lambda blocks, device, per_sm=0: 2)
        x = (10 * torch.randn(1, 1, in_features, generator=gen)).to(triton_device, dtype)
        stats = torch.full((1, 3), 100.0 * in_features / 3, device=triton_device)
        angles = torch.rand(1, 1, head_dim // 2, generator=gen).to(triton_device) * 6
        cos, sin = angles.cos(), angles.sin()
        slot = torch.tensor([5], device=triton_device)
        caches = [torch.zeros(2, 1, kv_heads, slots, head_dim, device=triton_device, dtype=dtype)]
        caches.append(caches[0].clone())
        outs = []
        for fn, (keys, values) in zip((fused_quant_qkv, quant_decode_qkv), caches, strict=True):
            args = (x, words, scales, fmt, 128, None, stats, 1e-6, cos, sin, keys, values, slot)
            outs.append(fn(*args, heads, kv_heads))
        assert outs[0].shape == outs[1].shape == (1, heads, 1, head_dim)
        tol = 2e-5 if dtype == torch.float32 else 1e-2
        for got, want in ((outs[0], outs[1]), (caches[0][0], caches[1][0])):
            scale = want.float().abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
        torch.testing.assert_close(caches[0][1], caches[1][1], rtol=tol, atol=tol * scale)
        assert caches[0][0][:, :, 5].abs().sum() > 0 and caches[0][0][:, :, 4].abs().sum() == 0


_FUSED_BUILD = """
import dataclasses
from slipstream.kernels.aot import compile_spec
from slipstream.kernels.ops.quant_matmul.fused_gemv import aot_specs

for target, half2 in (("sm_90", True), ("sm_80", True), ("gfx942", False)):
    for spec in aot_specs(half2):
        if target == "sm_90":  # with programmatic dependent launch and the L2 prefetch
            extra = {"GDC": True, "L2_PREFETCH": True}
            spec = dataclasses.replace(spec, constexprs={**spec.constexprs, **extra})
        result = compile_spec(spec, target)
        print(target, spec.name, result.ok, result.error[-300:].replace(chr(10), " "))
    # split-K (the workspace atomics and the last split's epilogue) in a persistent grid (the
    # next block's first tile loaded during the epilogue) with the two-step loop: QKV, add-norm
    for spec in aot_specs(half2)[1:3]:
        extra = {"SPLIT_K": 2, "PERSISTENT": True, "TWO_STEP": True}
        spec = dataclasses.replace(spec, constexprs={**spec.constexprs, **extra})
        result = compile_spec(spec, target)
        print(target, spec.name, "split2", result.ok, result.error[-300:].replace(chr(10), " "))
    # the epilogue's inputs loaded before the K loop, the norm's partial sums in one load
    for spec in aot_specs(half2)[1:3]:
        extra = {"EARLY_EPILOGUE": True, "STATS": 1024, "GDC": target == "sm_90"}
        spec = dataclasses.replace(spec, constexprs={**spec.constexprs, **extra})
        result = compile_spec(spec, target)
        print(target, spec.name, "early", result.ok, result.error[-300:].replace(chr(10), " "))
"""


@pytest.mark.aot
def test_fused_gemv_builds_for_nvidia_and_amd(tmp_path) -> None:
    """The fused kernel's PTX (f16x2 with the scaled activations, grid dependency control, the
    bulk L2 prefetch) assembles for sm_90 and sm_80; the portable path builds for gfx942; and
    the split-K variants (workspace atomics, the last split's epilogue) and the early epilogue
    loads with the one-pass norm statistics for all three."""
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
        [sys.executable, "-c", _FUSED_BUILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 30 and all(" True " in f"{line} " for line in lines), done.stdout


def test_one_pass_stats_and_early_epilogue(triton_device: torch.device) -> None:
    """``stats_one_pass`` (the norm's partial sums in one load: 600 of them here, three passes
    otherwise) equals the reference; ``early_epilogue`` (the epilogue's inputs loaded before
    the K loop) changes no bit of the QKV's queries and cache rows nor of the add + norm
    epilogue's outputs, alone and split in two K ranges (QKV: in a persistent grid); nor do
    ``late_trigger`` and ``l2_prefetch`` (launch details of programmatic dependent launch)."""
    from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_quant_gemv, fused_quant_qkv
    from slipstream.kernels.ops.quant_matmul.fused_table import FusedGemvConfig as C
    from slipstream.kernels.ops.quant_matmul.reference import quant_decode_qkv

    heads, kv_heads, head_dim = 2, 1, 16
    words, scales = _packed("int4", (heads + 2 * kv_heads) * head_dim, 2048)
    words, scales = words.to(triton_device), scales.to(triton_device)
    gen = _SEED(11)
    x = (10 * torch.randn(1, 1, 2048, generator=gen)).to(triton_device)
    parts = torch.rand(1, 600, generator=gen).to(triton_device) + 0.5
    stats = parts / parts.sum() * 2048 * 100
    angles = torch.rand(1, 1, head_dim // 2, generator=gen).to(triton_device) * 6
    slot = torch.tensor([3], device=triton_device)

    def qkv(config: C | None) -> tuple[torch.Tensor, ...]:
        caches = [torch.zeros(1, kv_heads, 4, head_dim, device=triton_device) for _ in "kv"]
        fn = quant_decode_qkv if config is None else fused_quant_qkv
        extra = {} if config is None else {"config": config}
        args = (x, words, scales, "int4", 128, None, stats, 1e-6, angles.cos(), angles.sin())
        out = fn(*args, *caches, slot, heads, kv_heads, **extra)
        return out, *caches

    want = qkv(None)
    plain = qkv(C(block_n=2, stats_one_pass=True))
    for got, expected in zip(plain, want, strict=True):
        scale = expected.abs().max().item()
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5 * scale)
    for config, late in (
        (C(block_n=2, stats_one_pass=True), plain),
        (C(block_n=2, stats_one_pass=True, split_k=2, programs_per_sm=1), None),
    ):
        late = late or qkv(config)
        early = qkv(dataclasses.replace(config, early_epilogue=True))
        for got, expected in zip(early, late, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the add + norm epilogue (output / down projections)
    out_words, out_scales = _packed("int4", 24, 2048, seed=12)
    out_words, out_scales = out_words.to(triton_device), out_scales.to(triton_device)
    row = x.reshape(1, -1)
    residual = torch.randn(1, 24, generator=gen).to(triton_device)
    weight = torch.randn(24, generator=gen).to(triton_device)
    args = (row, out_words, out_scales, "int4", 128)
    kwargs = {"residual": residual, "norm_weight": weight}
    for config in (C(block_n=4), C(block_n=4, split_k=2)):
        late = fused_quant_gemv(*args, **kwargs, config=config)
        early = fused_quant_gemv(
            *args, **kwargs, config=dataclasses.replace(config, early_epilogue=True)
        )
        for a, b in zip(early, late, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # programmatic dependent launch details (sm_90; plain launches elsewhere): the trigger
    # after the wait, no L2 prefetch of the weight — the same bits
    plain = fused_quant_gemv(*args, **kwargs, config=C(block_n=4), pdl="l2_partial")
    for fields in ({"late_trigger": True}, {"l2_prefetch": False}):
        got = fused_quant_gemv(*args, **kwargs, config=C(block_n=4, **fields), pdl="l2_partial")
        for a, b in zip(got, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fmt", "scale_dtype"),
    [("int4", "fp16"), ("int8", "fp16"), ("int4", "bf16"), ("fp8_e4m3", "fp16")],
)
def test_16bit_scales_in_every_kernel(
    triton_device: torch.device, fmt: str, scale_dtype: str
) -> None:
    """Scales stored in fp16 / bf16 (``quantize(scale_dtype=)``, ``quant.weight.scale_dtype``):
    the fused decode GEMV (plain, norm + SiLU * up, add + norm), the packed GEMV, the tile
    kernel and prefill's dequantization read them as the reference does (the same fp32
    products of the stored scales)."""
    from slipstream.kernels.ops.quant_matmul import quant_matmul
    from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_quant_gemv
    from slipstream.kernels.ops.quant_matmul.gemv import GemvConfig, dequantize_packed, launch_gemv
    from slipstream.kernels.ops.quant_matmul.reference import dequantize_weight

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[scale_dtype]
    out_features, in_features = 24, _IN[fmt]
    w = torch.randn(out_features, in_features, generator=_SEED(3))
    q = quantize(w, fmt, 128, scale_dtype=dtype)
    assert q.scales.dtype == dtype
    codes = q.data.reshape(out_features, -1).to(triton_device)
    words = pack_gemv(codes, fmt, 128, in_features)
    scales = q.scales.reshape(out_features, -1).to(triton_device)
    weight = dequantize_weight(codes, scales, fmt, 128, in_features, torch.float32)
    gen = _SEED(6)
    x = torch.randn(1, in_features, generator=gen).to(triton_device)
    stats = torch.full((1, 3), in_features / 3.0, device=triton_device)
    residual = torch.randn(1, out_features, generator=gen).to(triton_device)
    norm_weight = torch.randn(out_features, generator=gen).to(triton_device)
    for kwargs in (
        {},
        {"stats": stats, "eps": 1e-6, "gated": True},
        {"residual": residual, "norm_weight": norm_weight},
    ):
        got = fused_quant_gemv(x, words, scales, fmt, 128, **kwargs)
        want = reference(x, words, scales, fmt, 128, **kwargs)
        for a, b in zip(got[:2], want[:2], strict=True):
            if b is not None:
                assert a is not None
                tol = 2e-5 * b.abs().max().item()
                torch.testing.assert_close(a, b, rtol=2e-5, atol=tol)
    expected = x @ weight.t()
    tol = 2e-5 * expected.abs().max().item()
    for config in (GemvConfig(block_n=4), GemvConfig(block_n=4, split_k=2, prefetch=True)):
        got = launch_gemv(x, words, scales, fmt, 128, None, config)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=tol)
    torch.testing.assert_close(
        quant_matmul(x, codes, scales, fmt, 128), expected, rtol=2e-5, atol=tol
    )
    torch.testing.assert_close(
        dequantize_packed(words, scales, fmt, 128, in_features, torch.float32),
        weight,
        rtol=0,
        atol=0,
    )
    if triton_device.type == "cuda":  # the f16x2 path with 16-bit scales
        xb = x.to(torch.bfloat16)
        want_b = (xb.float() @ weight.t()).to(torch.bfloat16)
        for config in (GemvConfig(block_n=4, half2=True, prefetch=True, quads=True),):
            got = launch_gemv(xb, words, scales, fmt, 128, None, config)
            torch.testing.assert_close(
                got.float(), want_b.float(), rtol=1e-2, atol=1e-2 * tol / 2e-5
            )
        got = fused_quant_gemv(xb, words, scales, fmt, 128)[0]
        torch.testing.assert_close(got.float(), want_b.float(), rtol=1e-2, atol=1e-2 * tol / 2e-5)


@pytest.mark.gpu
def test_x_ahead_changes_no_bit() -> None:
    """``x_ahead`` (each K step's activations loaded a step ahead, f16x2 path) changes no bit
    of the output: int4 and int8, with and without the norm prologue, two-step and one-step
    loops, a persistent grid, and the add + norm epilogue."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import dataclasses

    from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_quant_gemv
    from slipstream.kernels.ops.quant_matmul.fused_table import FusedGemvConfig as C

    gen = _SEED(19)
    for fmt in ("int4", "int8"):
        words, scales = _packed(fmt, 512, 4096)
        words, scales = words.cuda(), scales.to("cuda", torch.float16)
        x = torch.randn(1, 4096, generator=gen).to("cuda", torch.bfloat16)
        stats = (torch.rand(1, 64, generator=gen) * 100).cuda()
        residual = torch.randn(1, 512, generator=gen).to("cuda", torch.bfloat16)
        norm_weight = torch.randn(512, generator=gen).to("cuda", torch.bfloat16)
        launches = (
            C(),
            C(two_step=True, num_warps=2),
            C(block_n=8, programs_per_sm=1),
            C(two_step=True, programs_per_sm=1),
        )
        for base in launches:
            hinted = dataclasses.replace(base, x_ahead=True)
            for kwargs in (
                {},
                {"stats": stats, "eps": 1e-5},
                {"residual": residual, "norm_weight": norm_weight},
            ):
                want = fused_quant_gemv(x, words, scales, fmt, 128, config=base, **kwargs)
                got = fused_quant_gemv(x, words, scales, fmt, 128, config=hinted, **kwargs)
                for a, b in zip(got, want, strict=True):
                    assert (a is None and b is None) or torch.equal(a, b), (fmt, base, kwargs)
