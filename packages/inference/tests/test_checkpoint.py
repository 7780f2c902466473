"""Hugging Face safetensors checkpoints, sharded with an index or single, loaded by init_inference."""

from __future__ import annotations

import pytest
import torch

from slipstream.inference import init_inference
from slipstream.inference.checkpoint import checkpoint_files, load_hf_checkpoint
from slipstream.inference.testing import tiny_hf_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sharded_checkpoint_loads_onto_meta_and_real_models(family: str, tmp_path) -> None:
    source = tiny_hf_model(family, seed=1)
    source.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(checkpoint_files(tmp_path)) > 1  # sharded, with model.safetensors.index.json
    ids = torch.randint(3, 96, (2, 8))
    expected = init_inference(source, dtype=torch.float32, replace_with_kernel_inject=True)(ids)

    other = tiny_hf_model(family, seed=2)  # different weights, replaced by the checkpoint's
    engine = init_inference(
        other, dtype=torch.float32, replace_with_kernel_inject=True, checkpoint=str(tmp_path)
    )
    torch.testing.assert_close(engine(ids).logits, expected.logits, rtol=0, atol=0)

    with torch.device("meta"):  # never materialised before the checkpoint's tensors arrive
        empty = transformers.AutoModelForCausalLM.from_config(source.config)
    engine = init_inference(
        empty, dtype=torch.float32, replace_with_kernel_inject=True, checkpoint=str(tmp_path)
    )
    torch.testing.assert_close(engine(ids).logits, expected.logits, rtol=0, atol=0)


def test_wrong_checkpoints_are_named(tmp_path) -> None:
    tiny_hf_model("llama", seed=1).save_pretrained(tmp_path)
    with pytest.raises(KeyError, match="does not have"):
        load_hf_checkpoint(tiny_hf_model("gpt2"), tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_hf_checkpoint(tiny_hf_model("llama"), tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors\.index\.json"):
        load_hf_checkpoint(tiny_hf_model("llama"), tmp_path / "empty")
