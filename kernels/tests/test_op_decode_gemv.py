"""``decode_gemv``, ``norm_gemv`` and ``gated_gemv``: references against the unfused steps, the
Triton kernel against the references (every prologue, ragged and even tiles, bias, a few rows)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import (
    add_rms_norm,
    decode_gemv,
    gated_activation,
    gated_gemv,
    norm_gemv,
    rms_norm,
)


def test_references_are_the_unfused_steps() -> None:
    x, r, nw = torch.randn(1, 40), torch.randn(1, 40), torch.randn(40)
    w, b = torch.randn(24, 40), torch.randn(24)
    torch.testing.assert_close(decode_gemv(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    total, y = norm_gemv(x, r, nw, 1e-5, w, b)
    expected_total, normed = add_rms_norm(x, r, nw, 1e-5)
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
    torch.testing.assert_close(y, F.linear(normed, w, b), rtol=0, atol=0)
    total, y = norm_gemv(x, None, nw, 1e-5, w)
    assert total is x
    torch.testing.assert_close(y, F.linear(rms_norm(x, nw, 1e-5), w), rtol=0, atol=0)
    gate_up = torch.randn(1, 80)
    torch.testing.assert_close(
        gated_gemv(gate_up, w, b), F.linear(gated_activation(gate_up), w, b), rtol=0, atol=0
    )


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).float()


@pytest.mark.parametrize("shape", [(1, 32, 512), (2, 20, 96)])  # even tiles; ragged N and K
def test_triton_matches_reference(triton_device: torch.device, shape: tuple[int, int, int]) -> None:
    from slipstream.kernels.ops.decode_gemv import triton as kernel
    from slipstream.kernels.ops.decode_gemv.reference import gated_gemv as gated_reference
    from slipstream.kernels.ops.decode_gemv.reference import norm_gemv as norm_reference

    rows, n, k = shape
    dtypes = [torch.float32, torch.float16]
    if triton_device.type == "cuda":
        dtypes.append(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)

    def rand(*size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(triton_device, dtype)

    block_k = 64 if k > 100 else 32
    # One program per block, and a persistent grid (8 "SMs" on the CPU; 1 program each walks
    # several blocks of 4 output features).
    configs = [
        kernel.DecodeGemvConfig(block_n=8, block_k=block_k),
        kernel.DecodeGemvConfig(block_n=4, block_k=block_k, programs_per_sm=1, prefetch=True),
        # norm_gemv's 1 / rms applied to the sum (no pass over the row first), persistent
        kernel.DecodeGemvConfig(block_n=4, block_k=block_k, programs_per_sm=1, defer_norm=True),
    ]
    with torch.no_grad():
        for dtype, config in [(d, c) for d in dtypes for c in configs]:
            # fp32 differs by summation order only; half precision by the one rounding of the
            # output after an fp32 sum of K products (relative ~2^-8 of the largest terms).
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            x, r, nw = rand(rows, k, dtype=dtype), rand(rows, k, dtype=dtype), rand(k, dtype=dtype)
            w, b = rand(n, k, dtype=dtype) / k**0.5, rand(n, dtype=dtype)
            for bias in (None, b):
                torch.testing.assert_close(
                    kernel.decode_gemv(x, w, bias, config),
                    F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(
                        dtype
                    ),
                    rtol=tol,
                    atol=tol,
                )
            for residual in (None, r):
                total, y = kernel.norm_gemv(x, residual, nw, 1e-6, w, b, config)
                expected_total, expected = norm_reference(x, residual, nw, 1e-6, w, b)
                # The residual sum is rounded as torch's add rounds it: bit-exact.
                torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
                torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
            gate_up = rand(rows, 2 * k, dtype=dtype)
            torch.testing.assert_close(
                kernel.gated_gemv(gate_up, w, b, config),
                gated_reference(gate_up, w, b),
                rtol=tol,
                atol=tol,
            )
        # The default launch (no config), and the reference past MAX_ROWS rows.
        x, w = rand(1, k, dtype=torch.float32), rand(n, k, dtype=torch.float32)
        torch.testing.assert_close(kernel.decode_gemv(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
        many = rand(kernel.MAX_ROWS + 1, k, dtype=torch.float32)
        torch.testing.assert_close(kernel.decode_gemv(many, w), F.linear(many, w))


def test_default_config_keeps_every_sm_busy() -> None:
    from slipstream.kernels.ops.decode_gemv.triton import default_config

    cpu = torch.device("cpu")  # 8 "SMs" off the GPU
    assert default_config(128256, 4096, cpu).block_n == 16  # lm_head: wide tiles
    assert default_config(64, 4096, cpu).block_n == 2  # tiny N: as many programs as it gets


# The Llama-3-8B decode shapes, by the fusion decode_fusion launches them with.
_8B = [("norm", 6144, 4096), ("plain", 4096, 4096), ("norm", 28672, 4096)]
_8B += [("gated", 4096, 14336), ("norm", 128256, 4096)]


@pytest.fixture
def no_user_table() -> Any:
    from slipstream.kernels.ops.decode_gemv import table

    table.use_launch_table(None)
    yield table
    table.use_launch_table(None)


def test_launch_table_lookup(no_user_table: Any, tmp_path: Any) -> None:
    table = no_user_table
    h100 = table.DeviceKey("NVIDIA H100 80GB HBM3", 132)
    # The H100's entries are the launches it ran before the table existed (85.2% of the limit),
    # QKV's with the rotary folded in.
    expected_block_n = [8, 4, 16, 4, 16]
    for (fusion, n, k), block_n in zip(_8B, expected_block_n, strict=True):
        config, source = table.lookup_launch(fusion, n, k, h100)
        assert source == "builtin"
        fold = (fusion, n) == ("norm", 6144)
        launch = table.DecodeGemvConfig(block_n=block_n, block_k=512, num_warps=4)
        assert config == dataclasses.replace(launch, fold_rotary=fold)
        assert dataclasses.replace(config, fold_rotary=False) == table.default_rule(n, k, 132)
    # TP=2 shards on the H100: the sweep's tiles
    assert table.lookup_launch("norm", 3072, 4096, h100)[0].prefetch
    assert table.lookup_launch("plain", 4096, 2048, h100)[0].block_n == 8
    # The H200's, from the sweep on it: wider tiles for QKV and the head, a persistent
    # prefetching grid for gate/up, the default launch kept for the output and down.
    h200 = table.DeviceKey("NVIDIA H200", 132)
    h200_block_n = [32, 4, 8, 4, 32]
    for (fusion, n, k), block_n in zip(_8B, h200_block_n, strict=True):
        config, source = table.lookup_launch(fusion, n, k, h200)
        assert source == "builtin" and config.block_n == block_n
    assert table.lookup_launch("norm", 28672, 4096, h200)[0].prefetch
    # Other GPUs (an H100 PCIe's 114 SMs, ROCm) and other shapes: the default rule.
    for key in (table.DeviceKey("NVIDIA H100 PCIe", 114), table.DeviceKey("AMD MI300X", 304)):
        assert table.lookup_launch("norm", 6144, 4096, key) == (
            table.default_rule(6144, 4096, key.sms),
            "default",
        )
    assert table.lookup_launch("norm", 6144, 2048, h100)[1] == "default"
    assert table.lookup_launch("plain", 6144, 4096, h100)[1] == "default"  # another fusion
    # A user table (bf16_gemv_bench.py --table-out's format) comes first; unlisted: as before.
    path = tmp_path / "table.json"
    entry = {"device": "h100", "sms": 132, "fusion": "norm", "n": 6144, "k": 4096}
    launch = {"block_n": 32, "block_k": 256, "num_warps": 8, "num_stages": 4, "split_k": 2}
    path.write_text(json.dumps({"version": 1, "entries": [{**entry, **launch}]}))
    table.use_launch_table(table.load_launch_table(path))
    assert table.lookup_launch("norm", 6144, 4096, h100) == (
        table.DecodeGemvConfig(**launch),
        "user",
    )
    assert table.lookup_launch("norm", 28672, 4096, h100)[1] == "builtin"
    assert table.lookup_launch("norm", 6144, 4096, h200)[1] == "builtin"
    # What the sweep writes reads back the same.
    entries = table.parse_launch_table(table.table_json(table.BUILTIN_TABLE))
    assert tuple(entries) == table.BUILTIN_TABLE


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file"),
        ("{not json", "is not JSON"),
        ("[]", "'entries' list"),
        ('{"version": 2, "entries": []}', "version 2"),
        ('{"entries": [], "extra": 1}', "unknown top-level key"),
        ('{"entries": [7]}', r"entries\[0\]: an entry must be a JSON object"),
        ('{"entries": [{"device": "H200", "fusion": "norm", "n": 8, "k": 8}]}', "missing"),
        ("ENTRY", r"entries\[0\]: unknown key\(s\) \['blockn'\]"),
    ],
)
def test_bad_launch_table_is_a_named_error(
    no_user_table: Any, tmp_path: Any, content: str | None, message: str
) -> None:
    table = no_user_table
    path = tmp_path / "bad.json"
    if content == "ENTRY":
        bad = {"device": "H200", "fusion": "norm", "n": 8, "k": 8, "blockn": 8}
        content = json.dumps({"entries": [{**bad, "block_n": 8, "block_k": 8, "num_warps": 4}]})
    if content is not None:
        path.write_text(content)
    with pytest.raises(table.LaunchTableError, match=message) as caught:
        table.load_launch_table(path)
    assert "bad.json" in str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_n", 12, "power of two"),
        ("num_warps", 0, ">= 1"),
        ("split_k", 0, ">= 1"),
        ("programs_per_sm", -1, ">= 0"),
        ("prefetch", "yes", "true or false"),
        ("fusion", "swiglu", "'fusion' must be one of"),
        ("n", "4096", "'n' must be an integer"),
        ("sms", 0, "'sms' must be an integer"),
        ("device", "", "non-empty string"),
    ],
)
def test_bad_launch_entry_names_its_field(
    no_user_table: Any, field: str, value: object, message: str
) -> None:
    good = {"device": "H200", "fusion": "norm", "n": 8, "k": 8, "block_n": 8, "block_k": 8}
    entry = {**good, "num_warps": 4, field: value}
    with pytest.raises(no_user_table.LaunchTableError, match=message) as caught:
        no_user_table.parse_launch_table({"entries": [good | {"num_warps": 4}, entry]}, "T")
    assert str(caught.value).startswith("T: entries[1]")


def test_any_table_entry_stays_exact(
    triton_device: torch.device, no_user_table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever launch a table gives (tile sizes, prefetch, persistent grid, split-K with
    ragged splits), the ops called without a config look it up and match the references."""
    from slipstream.kernels.ops.decode_gemv import triton as kernel
    from slipstream.kernels.ops.decode_gemv.reference import gated_gemv as gated_reference
    from slipstream.kernels.ops.decode_gemv.reference import norm_gemv as norm_reference

    table = no_user_table
    name = table.device_key(triton_device).name
    used: list[tuple[Any, str]] = []

    def spy(*args: Any) -> tuple[Any, str]:
        used.append(table.lookup_launch(*args))
        return used[-1]

    monkeypatch.setattr(kernel, "lookup_launch", spy)
    generator = torch.Generator().manual_seed(1)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(triton_device)

    n, k = 12, 80  # ragged against every block_n and block_k below
    launches = [
        {"block_n": 16, "block_k": 64, "num_warps": 8, "num_stages": 4, "early": True},
        {"block_n": 4, "block_k": 32, "num_warps": 2, "prefetch": True, "split_k": 3},
        {"block_n": 8, "block_k": 16, "num_warps": 4, "programs_per_sm": 1, "split_k": 2},
        {"block_n": 8, "block_k": 32, "num_warps": 1, "split_k": 8},  # more splits than steps
        # pdl: the first tile loaded first, used by the first block only (persistent grids of
        # 8 programs per 8 "SMs" for 12 blocks); the grid-dependency wait runs on sm_90+ only.
        {"block_n": 1, "block_k": 32, "num_warps": 4, "pdl": True, "programs_per_sm": 1},
        {"block_n": 1, "block_k": 16, "num_warps": 2, "prefetch": True, "pdl": True}
        | {"programs_per_sm": 1, "split_k": 2},
        # pdl with the program's rows prefetched into L2 before the wait (sm_90+), persistent
        # grids too; norm_gemv's 1 / rms applied to the sum (ignored with split-K)
        {"block_n": 2, "block_k": 32, "num_warps": 4, "pdl": True, "l2_prefetch": True}
        | {"late_trigger": True},
        {"block_n": 1, "block_k": 32, "pdl": True, "l2_prefetch": True, "programs_per_sm": 1}
        | {"num_warps": 4, "defer_norm": True, "l2_prefetch_blocks": 1},
        {"block_n": 4, "block_k": 16, "num_warps": 2, "defer_norm": True, "split_k": 2},
    ]
    inputs = [rand(2, k), rand(2, k), rand(k), rand(n, k) / k**0.5, rand(n), rand(2, 2 * k)]
    # CPU: fp32, and fp16 (the split-K parts add into an fp32 output there: the normalised row
    # must still be rounded to fp16 where add_rms_norm rounds it).
    dtypes = [torch.float32, torch.float16] if triton_device.type == "cpu" else [torch.bfloat16]
    with torch.no_grad():
        for dtype, launch in [(d, launch) for d in dtypes for launch in launches]:
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            x, r, nw, w, b, gate_up = (t.to(dtype) for t in inputs)
            entries = [
                {"device": name, "fusion": fusion, "n": n, "k": k, **launch}
                for fusion in table.FUSIONS
            ]
            table.use_launch_table(table.parse_launch_table({"entries": entries}))
            used.clear()
            # On a GPU twice: split-K leaves its workspace and arrival counters at rest.
            for _ in range(2 if triton_device.type == "cuda" else 1):
                torch.testing.assert_close(
                    kernel.decode_gemv(x, w, b),
                    F.linear(x.float(), w.float(), b.float()).to(dtype),
                    rtol=tol,
                    atol=tol,
                )
                total, y = kernel.norm_gemv(x, r, nw, 1e-6, w, b)
                expected_total, expected = norm_reference(x, r, nw, 1e-6, w, b)
                torch.testing.assert_close(total, expected_total, rtol=0, atol=0)
                torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
                torch.testing.assert_close(
                    kernel.gated_gemv(gate_up, w, b),
                    gated_reference(gate_up, w, b),
                    rtol=tol,
                    atol=tol,
                )
            # Each op launched the table's entry.
            assert used and set(used) == {(table.DecodeGemvConfig(**launch), "user")}


def test_norm_gemv_rotary_matches_reference(
    triton_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QKV with rotary_kv_write in its epilogue: the queries, keys and values written into the
    caches and the residual sum as norm_gemv then rotary_kv_write give them (one launch where
    block_n divides head_dim, persistent grids and defer_norm too; else the two ops)."""
    from slipstream.kernels.ops.decode_gemv import triton as kernel
    from slipstream.kernels.ops.decode_gemv.reference import norm_gemv_rotary as reference

    heads, kv_heads, head_dim, hidden, slots = 4, 2, 16, 64, 8
    fused: list[bool] = []
    launch = kernel._launch

    def spy(*args: Any) -> Any:
        fused.append(len(args) > 10 and args[10] is not None)
        return launch(*args)

    monkeypatch.setattr(kernel, "_launch", spy)
    n = (heads + 2 * kv_heads) * head_dim
    generator = torch.Generator().manual_seed(3)
    dtypes = [torch.float32] if triton_device.type == "cpu" else [torch.bfloat16]
    fold = {"fold_rotary": True}
    configs = [
        kernel.DecodeGemvConfig(block_n=8, block_k=32, **fold),
        kernel.DecodeGemvConfig(block_n=16, block_k=64, programs_per_sm=1, defer_norm=True, **fold),
        kernel.DecodeGemvConfig(block_n=4, block_k=16, prefetch=True, split_k=2, pdl=True, **fold),
        kernel.DecodeGemvConfig(block_n=32, block_k=32, **fold),  # wider than a head: two ops
    ]

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(triton_device)

    with torch.no_grad():
        for dtype, config in [(d, c) for d in dtypes for c in configs]:
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            for batch, residual in ((1, True), (2, False)):
                x, res = rand(batch, 1, hidden).to(dtype), rand(batch, 1, hidden).to(dtype)
                nw, w = rand(hidden).to(dtype), (rand(n, hidden) / hidden**0.5).to(dtype)
                b = rand(n).to(dtype)
                angle = rand(batch, 1, head_dim // 2)
                cos, sin = angle.cos(), angle.sin()
                caches = [rand(batch, kv_heads, slots, head_dim).to(dtype) for _ in range(2)]
                caches += [cache.clone() for cache in caches]
                where = torch.tensor([5], device=triton_device)
                args = (x, res if residual else None, nw, 1e-6, w, b, cos, sin)
                total, q = kernel.norm_gemv_rotary(
                    *args, caches[0], caches[1], where, heads, kv_heads, config
                )
                want_total, want_q = reference(*args, caches[2], caches[3], where, heads, kv_heads)
                torch.testing.assert_close(total, want_total, rtol=0, atol=0)
                assert q.shape == (batch, heads, 1, head_dim)
                torch.testing.assert_close(q, want_q, rtol=tol, atol=tol)
                torch.testing.assert_close(caches[0], caches[2], rtol=tol, atol=tol)
                torch.testing.assert_close(caches[1], caches[3], rtol=tol, atol=tol)
                # one launch, rotary in its epilogue, unless block_n is wider than a head
                assert fused == [config.fold_rotary and config.block_n <= head_dim]
                fused.clear()
