"""What a model receives under the seqlen curriculum: the keyword, an aligned truncation, or
DeepSpeed's reshape."""

from __future__ import annotations

import pytest
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


def test_reshape_cuts_rows_into_pieces_then_tails_as_megatron_deepspeed() -> None:
    """DeepSpeed's seqlen_reshape: each row's full pieces in order, then each row's last
    ``width`` tokens, keeping ceil(numel / width) rows (one fewer when odd and above one)."""
    from slipstream.data import reshape_batch, reshaped_rows

    ids = torch.arange(2 * 10).view(2, 10)
    # ceil(20 / 3) = 7 -> odd -> 6 rows: the six full pieces, no tail, remainders left out.
    out = reshape_batch(ids, 3)
    expected = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [10, 11, 12], [13, 14, 15], [16, 17, 18]]
    assert out.tolist() == expected
    # Tails are used: 3 rows of 10, width 4 -> 6 pieces + tails of rows 0 and 1 (8 rows).
    ids = torch.arange(3 * 10).view(3, 10)
    assert reshape_batch(ids, 4).tolist() == [
        [0, 1, 2, 3], [4, 5, 6, 7], [10, 11, 12, 13], [14, 15, 16, 17],
        [20, 21, 22, 23], [24, 25, 26, 27], [6, 7, 8, 9], [16, 17, 18, 19],
    ]  # fmt: skip
    assert reshaped_rows(3, 10, 4) == 8 and reshaped_rows(2, 10, 3) == 6
    # One row of 5, width 3: its one piece and its tail (overlapping); a width at or past the
    # length changes nothing.
    assert reshape_batch(torch.arange(5).view(1, 5), 3).tolist() == [[0, 1, 2], [2, 3, 4]]
    assert reshaped_rows(1, 5, 3) == 2
    same = torch.arange(8).view(2, 4)
    assert reshape_batch(same, 4) is same and reshaped_rows(2, 4, 9) == 2
    # The GPT recipe's first step: 16 windows of 2049 tokens, curriculum_seqlen 80 -> width 81:
    # 25 pieces per row (400) + 4 tails = ceil(32784 / 81) = 405 -> 404 rows.
    text = torch.arange(16 * 2049).view(16, 2049)
    out = reshape_batch(text, 81)
    assert out.shape == (404, 81) and reshaped_rows(16, 2049, 81) == 404
    assert torch.equal(out[25], text[1, :81]) and torch.equal(out[400], text[0, -81:])
    with pytest.raises(ValueError, match="batch, length"):
        reshape_batch(torch.arange(4), 2)


def test_seqlen_post_process_truncates_or_reshapes_by_the_metric_name() -> None:
    from slipstream.data import reshape_batch, seqlen_post_process

    text = torch.arange(4 * 9).view(4, 9)  # seq 8 plus the label column
    batch = {"text": text, "other": 1}
    cut = seqlen_post_process(batch, {"current_difficulties": {"seqlen_truncate": 3}})
    assert torch.equal(cut["text"], text[:, :4]) and cut["other"] == 1
    reshaped = seqlen_post_process(batch, {"current_difficulties": {"seqlen_reshape": 3}})
    assert torch.equal(reshaped["text"], reshape_batch(text, 4))
    assert reshaped["text"].shape == (8, 4)  # ceil(36 / 4) = 9 -> 8
    for progress in ({"current_difficulties": {"seqlen_reshape": 8}}, {}):
        assert seqlen_post_process(batch, progress)["text"] is text  # full length: unchanged
