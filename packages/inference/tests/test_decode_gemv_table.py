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
