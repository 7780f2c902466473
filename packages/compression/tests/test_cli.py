"""``slipstream compress``: a saved model and a DeepSpeed config in, the packed export out."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from safetensors import safe_open

from slipstream.compression.cli import Progress, main
from slipstream.compression.testing import tiny_llama


def test_compress_command_writes_the_export(tmp_path: Path, capsys) -> None:
    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    config = {
        "train_batch_size": 8,
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "quantize_group_size": 16},
                "different_groups": {
                    "wq1": {
                        "params": {"start_bits": 4, "target_bits": 4},
                        "modules": ["self_attn", "mlp"],
                    }
                },
            }
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(config))
    torch.save(torch.randint(0, 96, (4, 16)), tmp_path / "calib.pt")
    status = main(
        [
            str(tmp_path / "model"),
            "--config", str(tmp_path / "ds.json"),
            "--output", str(tmp_path / "out"),
            "--calibration", str(tmp_path / "calib.pt"),
            "--lkd-steps", "2",
        ]
    )  # fmt: skip
    assert status == 0
    captured = capsys.readouterr()
    assert "5/5" in captured.err and "14 weights packed" in captured.out
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        header = json.loads(handle.metadata()["quantized"])
    assert header["model.layers.1.mlp.down_proj.weight"]["format"] == "int4"
    assert (tmp_path / "out" / "config.json").exists()


def test_progress_bar_counts_stages() -> None:
    stream = io.StringIO()
    progress = Progress(2, stream)
    progress.update("one")
    progress.update("two")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("compress [############............] 1/2 one")
    assert "2/2 two" in lines[1]
