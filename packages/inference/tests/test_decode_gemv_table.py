"""``decode_gemv_table``: init_inference installs a launch table file; a bad one is a named error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.testing import tiny_hf_model
from slipstream.kernels.ops.decode_gemv import table

pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _no_user_table() -> Iterator[None]:
    table.use_launch_table(None)
    yield
    table.use_launch_table(None)


def test_decode_gemv_table_key(tmp_path: Path) -> None:
    model = tiny_hf_model("llama")
    common = {"replace_with_kernel_inject": True, "dtype": torch.bfloat16, "decode_fusion": True}
    h200 = table.DeviceKey("NVIDIA H200", 132)
    assert table.lookup_launch("norm", 6144, 4096, h200)[1] != "user"
    path = tmp_path / "h200.json"
    launch = {"block_n": 16, "block_k": 1024, "num_warps": 8, "split_k": 1}
    entry = {"device": "NVIDIA H200", "sms": 132, "fusion": "norm", "n": 6144, "k": 4096}
    path.write_text(json.dumps({"version": 1, "entries": [{**entry, **launch}]}))
    engine = init_inference(model, decode_gemv_table=str(path), **common)
    assert engine.config.decode_gemv_table == str(path)
    assert table.lookup_launch("norm", 6144, 4096, h200) == (
        table.DecodeGemvConfig(**launch),
        "user",
    )
    # A missing file, or an entry the kernels cannot launch: init_inference names the key.
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=r"decode_gemv_table = '.*missing\.json'.*--table-out"):
        init_inference(model, decode_gemv_table=str(missing), **common)
    path.write_text(json.dumps({"entries": [{**entry, **launch, "block_n": 6}]}))
    with pytest.raises(ValueError, match=r"decode_gemv_table.*entries\[0\]: 'block_n'"):
        init_inference(model, decode_gemv_table=str(path), **common)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_table_launches_in_the_decode_graph(tmp_path: Path) -> None:
    """Table launches with split-K, prefetch and programmatic dependent launch (sm_90+) inside
    the captured decode step: graph equals eager, and the step stays near the unfused one."""
    model = tiny_hf_model("llama").cuda()
    config: dict = {"dtype": torch.bfloat16, "replace_with_kernel_inject": True}
    probe = init_inference(model, config, decode_fusion=True, max_out_tokens=32)
    assert probe.fused is not None
    block = probe.fused.blocks[0]
    shapes = [("norm", *block.qkv.weight.shape), ("plain", *block.out.weight.shape)]
    shapes += [("norm", *block.up.weight.shape), ("gated", *block.down.weight.shape)]
    shapes += [("norm", *probe.fused.head.weight.shape)]
    launch = {"block_n": 4, "block_k": 32, "num_warps": 4, "prefetch": True, "pdl": True}
    name = torch.cuda.get_device_name()
    entries = [
        {"device": name, "fusion": f, "n": n, "k": k, **launch, "split_k": 2} for f, n, k in shapes
    ]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": entries}))
    ids = torch.randint(3, 96, (1, 9), device="cuda")
    kwargs = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    engines = [
        init_inference(
            model,
            config,
            decode_fusion=True,
            decode_gemv_table=str(path),
            enable_cuda_graph=graph,
            max_out_tokens=32,
        )
        for graph in (False, True)
    ]
    for fusion, n, k in shapes:
        assert table.lookup_launch(fusion, n, k, torch.device("cuda"))[1] == "user"
    outputs = [engine.generate(ids, **kwargs) for engine in engines]
    runner = engines[1]._runner
    assert runner is not None and runner.buckets[1].graph is not None  # captured, not eager
    assert torch.equal(outputs[0], outputs[1])
    steps = []
    for fusion in (True, False):
        engine = init_inference(model, config, decode_fusion=fusion, max_out_tokens=32)
        assert engine._runner is not None
        with torch.no_grad():
            engine._runner.prefill(ids, torch.arange(9, device="cuda")[None], ids > 0)
            steps.append(engine._runner.decode(ids[:, -1], torch.tensor([9], device="cuda"), 9))
    error = (steps[0].float() - steps[1].float()).abs().max() / steps[1].float().abs().max()
    assert error.item() < 0.02
