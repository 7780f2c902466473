"""``slipstream.init_inference`` on a ZeRO-3 checkpoint saved by 2 ranks: the served model's logits
equal the trained engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.comm.testing import run_distributed

pytest.importorskip("transformers")

PROBE = torch.tensor([[5, 17, 42, 8, 61, 3, 29]])


def _train_and_save(root: str) -> torch.Tensor:
    import slipstream
    from slipstream.inference.testing import tiny_hf_model

    model = tiny_hf_model("llama", layers=2, seed=0)
    config = {
        "train_batch_size": 4,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # two steps: the saved weights are the trained ones, not the init
        ids = torch.randint(3, 96, (4, 9), generator=generator)
        mine = ids[2 * torch.distributed.get_rank() :][:2]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag="trained")
    engine.eval()
    with torch.no_grad():
        return engine(input_ids=PROBE).logits.detach().clone()


def test_zero3_two_rank_checkpoint_serves_with_the_trained_logits(tmp_path: Path) -> None:
    import slipstream
    from slipstream.inference.testing import tiny_hf_model

    trained = run_distributed(_train_and_save, 2, str(tmp_path), timeout=300)[0]
    fresh = tiny_hf_model("llama", layers=2, seed=7)  # other weights until the checkpoint loads
    before = slipstream.init_inference(
        tiny_hf_model("llama", layers=2, seed=7), dtype=torch.float32
    )(PROBE).logits
    for checkpoint in (str(tmp_path), str(tmp_path / "trained")):  # the root, or one tag
        engine = slipstream.init_inference(
            fresh, dtype=torch.float32, replace_with_kernel_inject=True, checkpoint=checkpoint
        )
        logits = engine(PROBE).logits
        torch.testing.assert_close(logits, trained, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, trained, atol=1e-2)  # the load changed the weights
    wrong = tiny_hf_model("qwen2", layers=1)
    with pytest.raises(ValueError, match="does not match the model"):
        slipstream.init_inference(wrong, dtype=torch.float32, checkpoint=str(tmp_path))
