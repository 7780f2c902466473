"""``quant.weight.decode_gemv_table`` / ``decode_pdl``: the fused quantized decode GEMVs'
launch table file and launch option, installed by init_inference; bad values are named errors."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.testing import tiny_hf_model
from slipstream.kernels.ops.quant_matmul import fused_table
from slipstream.kernels.ops.quant_matmul.fused_gemv import fused_config

pytest.importorskip("transformers")

H200 = ("NVIDIA H200", 132)
ENTRY = {"device": "H200", "sms": 132, "format": "int4", "fusion": "gate_up", "n": 28672}


@pytest.fixture(autouse=True)
def _no_user_table() -> Iterator[None]:
    fused_table.use_fused_table(None)
    yield
    fused_table.use_fused_table(None)


def _settings(**weight: object) -> dict:
    quant = {"weight": {"num_bits": 4, "group_size": 32, "compute_dtype": "bf16", **weight}}
    return {"dtype": "int8", "replace_with_kernel_inject": True, "quant": quant}


def test_table_key_installs_the_launches(tmp_path: Path) -> None:
    launch = {"block_n": 8, "num_warps": 2, "split_k": 2, "programs_per_sm": 4}
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({"version": 1, "entries": [{**ENTRY, "k": 4096, "config": launch}]}))
    assert fused_table.lookup_fused("int4", "gate_up", 28672, 4096, H200) is None
    engine = init_inference(tiny_hf_model("llama"), _settings(decode_gemv_table=str(path)))
    assert engine.config.quant.weight.decode_gemv_table == str(path)
    # "auto": the partial L2 prefetch for int4, the whole-weight one for int8 / fp8
    assert engine.fused is not None and engine.fused.quant_pdl == "l2_partial"
    weight = engine.config.quant.weight
    assert dataclasses.replace(weight, num_bits=8).pdl_mode == "on"
    assert dataclasses.replace(weight, decode_pdl=True).pdl_mode == "on"
    found = fused_table.lookup_fused("int4", "gate_up", 28672, 4096, H200)
    assert found == (fused_table.FusedGemvConfig(**launch), "user")
    # the built-in entries: H100 int8 (call B2) and int4 (call B1 of 11:29; QKV and down from
    # call S4 with fp16 scales), nothing for other GPUs
    h100 = ("NVIDIA H100 80GB HBM3", 132)
    found = fused_table.lookup_fused("int8", "qkv", 6144, 4096, h100)
    assert found is not None and found[1] == "builtin" and found[0].two_step
    found = fused_table.lookup_fused("int4", "add_norm", 4096, 14336, h100)
    assert found is not None and found[1] == "builtin" and found[0].split_k == 1
    assert found[0].early_epilogue and found[0].two_step and found[0].num_warps == 2
    found = fused_table.lookup_fused("int4", "qkv", 6144, 4096, h100)
    assert found is not None and found[0].stats_one_pass and found[0].early_epilogue
    # other GPUs (an H100 with another SM count), formats and shapes: no entry (the rule)
    assert fused_table.lookup_fused("int4", "gate_up", 28672, 4096, ("NVIDIA H100", 114)) is None
    assert fused_table.lookup_fused("int8", "gate_up", 28672, 4096, H200) is None
    # the rule's launch for a CPU shape (what the sweep starts from), and the written table
    # reads back as what was written
    rule = fused_config("int4", "add_norm", 64, 2048, 128, torch.device("cpu"))
    assert rule is not None and rule.split_k == 1
    entries = fused_table.parse_fused_table(json.loads(path.read_text()))
    assert fused_table.parse_fused_table(fused_table.fused_table_json(entries)) == entries


def test_bad_table_and_pdl_values_are_named(tmp_path: Path) -> None:
    model = tiny_hf_model("llama")
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=r"quant.weight.decode_gemv_table = '.*missing\.json'"):
        init_inference(model, _settings(decode_gemv_table=str(missing)))
    path = tmp_path / "bad.json"
    for config, message in (
        ({"block_n": 6}, r"entries\[0\].config.block_n = 6: a power of two"),
        ({"blocks": 4}, r"entries\[0\].config.blocks: unknown"),
        ({"split_k": 2.0}, r"entries\[0\].config.split_k = 2.0: expected int"),
    ):
        entry = {**ENTRY, "k": 4096, "config": config}
        path.write_text(json.dumps({"version": 1, "entries": [entry]}))
        with pytest.raises(ValueError, match=message):
            init_inference(model, _settings(decode_gemv_table=str(path)))
    path.write_text(json.dumps({"version": 1, "entries": [{**ENTRY, "fusion": "norm2"}]}))
    with pytest.raises(ValueError, match=r"entries\[0\].fusion = 'norm2'"):
        init_inference(model, _settings(decode_gemv_table=str(path)))
    with pytest.raises(ValueError, match=r"quant.weight.decode_pdl"):
        init_inference(model, _settings(decode_pdl="sometimes"))
    engine = init_inference(model, _settings(decode_pdl=False))
    assert engine.fused is not None and engine.fused.quant_pdl == "off"


def test_the_8b_head_has_a_launch_at_either_width() -> None:
    """An int8 LM head behind int4 blocks (quant.weight.lm_head_bits) launches its fused
    norm-prologue GEMV with the unfused sweep's tile for the 8B head shape, as an int4 one."""
    from slipstream.kernels.ops.quant_matmul.gemv import GEMV_TABLE

    for fmt in ("int8", "int4"):
        config = fused_config(fmt, "norm", 128256, 4096, 128, torch.device("cpu"))
        swept = GEMV_TABLE[(fmt, 128256, 4096)]
        assert config is not None, fmt
        assert (config.block_n, config.num_warps) == (swept.block_n, swept.num_warps), fmt
        assert config.prefetch  # the norm prologue's statistics load behind the first tile
