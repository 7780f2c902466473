"""What a model receives under the seqlen curriculum: the keyword, or an aligned truncation."""

from __future__ import annotations

import torch
from torch import nn

from slipstream.data import apply_seqlen_curriculum, truncate_batch


class Plain(nn.Module):
    def forward(self, batch: dict) -> None:  # pragma: no cover - never run
        raise AssertionError


class Aware(nn.Module):
    def forward(self, input_ids: torch.Tensor, curriculum_seqlen: int | None = None) -> None:
        raise AssertionError  # pragma: no cover


def test_truncation_keeps_inputs_labels_and_masks_aligned() -> None:
    ids = torch.arange(2 * 10).view(2, 10)
    batch = {
        "input_ids": ids,
        "labels": ids + 100,
        "attention_mask": torch.ones(2, 1, 10, 10),
        "position_ids": [torch.arange(10).expand(2, 10)],
        "scale": torch.tensor([1.0, 2.0]),  # 1-d: not a sequence
        "note": "kept",
    }
    args, kwargs = apply_seqlen_curriculum(Plain(), (batch,), {}, 4)
    out = args[0]
    assert torch.equal(out["input_ids"], ids[:, :4])
    assert torch.equal(out["labels"], ids[:, :4] + 100)
    assert out["attention_mask"].shape == (2, 1, 4, 4)
    assert out["position_ids"][0].shape == (2, 4)
    assert torch.equal(out["scale"], batch["scale"]) and out["note"] == "kept"
    assert kwargs == {}
    # Longer than the batch: nothing changes.
    assert truncate_batch(batch, 16) is batch


def test_a_model_that_takes_curriculum_seqlen_gets_the_keyword_and_the_full_batch() -> None:
    ids = torch.zeros(2, 10, dtype=torch.long)
    args, kwargs = apply_seqlen_curriculum(Aware(), (ids,), {}, 4)
    assert args[0] is ids and kwargs == {"curriculum_seqlen": 4}
