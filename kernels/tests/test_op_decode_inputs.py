"""``decode_inputs``: the reference against the decoder's own prologue ops, the Triton kernel
against the reference bit for bit (GQA and MHA, sliding window, learned positions, no rotary,
batch 2 with left padding, fp32 / fp16 / bf16, the key-valid write)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import decode_inputs
from slipstream.kernels.ops.decode_inputs.reference import decode_inputs as reference

VOCAB, HIDDEN, KEYS, HALF = 50, 24, 40, 4


def _tables(length: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    angles = torch.arange(length)[..., None].float() * inv_freq.float()
    return angles.cos(), angles.sin()


def _inputs(device: torch.device, dtype: torch.dtype, learned: bool, slot: int = 17):
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 7], [2, 41]])[:, 1:]  # a strided view, as a prompt's last column
    pads = torch.tensor([0, 5])  # row 1 is left-padded: its first five slots hold no token
    positions = (slot - pads)[:, None]
    key_valid = torch.zeros(2, KEYS, dtype=torch.bool)
    for row, pad in enumerate(pads.tolist()):
        key_valid[row, pad:slot] = True
    key_valid[1, 3] = True  # stale flags after the slot and inside padding must not leak
    key_valid[0, slot + 4] = True
    embed = torch.randn(VOCAB, HIDDEN, generator=generator)
    position_weight = torch.randn(slot + 8, HIDDEN, generator=generator) if learned else None
    cos, sin = _tables(KEYS, HALF)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return (
        ids.to(device),
        positions.to(device),
        key_valid.to(device),
        torch.tensor([slot], device=device),
        embed.to(device, dtype),
        None if position_weight is None else position_weight.to(device, dtype),
        move(cos),
        move(sin),
    )


def test_reference_is_the_decoder_prologue() -> None:
    """Embedding (+ learned positions at offset 2), cos/sin of the positions' fp32 angles, and
    the boolean mask made additive, as the fused decoder computes them step by step."""
    ids, positions, valid, slots, embed, pos_w, cos_t, sin_t = _inputs(
        torch.device("cpu"), torch.bfloat16, learned=True
    )
    before = valid.clone()
    x, cos, sin, mask = reference(ids, positions, valid, slots, embed, pos_w, 2, cos_t, sin_t, 6, 3)
    assert torch.equal(valid, before)  # mark_valid off: key_valid untouched
    assert torch.equal(x, F.embedding(ids, embed) + F.embedding(positions + 2, pos_w))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * HALF, 2, dtype=torch.float64) / (2 * HALF)))
    angles = positions[..., None].float() * inv_freq.float()
    assert cos is not None and sin is not None
    assert torch.equal(cos, angles.cos()[:, :, None]) and torch.equal(sin, angles.sin()[:, :, None])
    slot = int(slots)
    keys = torch.arange(KEYS)
    seen = (keys <= slot) & (slot - keys < 6) & valid | (keys == slot)
    expected = torch.zeros(2, 1, 3, KEYS, dtype=torch.bfloat16)
    expected.masked_fill_(~seen[:, None, None, :], float("-inf"))
    assert torch.equal(mask, expected)
    assert mask[1, 0, 0, :11].isinf().all() and mask[0, 0, 0, slot + 4].isinf()
    reference(ids, positions, valid, slots, embed, pos_w, 2, cos_t, sin_t, 6, 3, mark_valid=True)
    assert valid[:, slot].all() and torch.equal(valid[:, :slot], before[:, :slot])
    with pytest.raises(ValueError, match="one token per row"):
        reference(ids.repeat(1, 2), positions, valid, slots, embed, None, 0, None, None, None, 1)
    with pytest.raises(ValueError, match="both cos_table and sin_table"):
        reference(ids, positions, valid, slots, embed, None, 0, cos_t, None, None, 1)


@pytest.mark.parametrize(
    ("learned", "window", "group", "rotary"),
    [(False, None, 4, True), (False, 6, 2, True), (True, None, 1, False), (False, None, 1, True)],
)
def test_triton_matches_reference_exactly(
    triton_device: torch.device, learned: bool, window: int | None, group: int, rotary: bool
) -> None:
    from slipstream.kernels.ops.decode_inputs.triton import decode_inputs as kernel

    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    for dtype in dtypes:
        args = list(_inputs(triton_device, dtype, learned))
        if not rotary:
            args[6] = args[7] = None
        valid = args[2]
        expected_valid = valid.clone()
        offset = 2 if learned else 0
        for mark in (False, True):
            expected = reference(
                *args[:2],
                expected_valid,
                *args[3:6],
                offset,
                *args[6:],
                window,
                group,
                mark_valid=mark,
            )
            got = kernel(*args[:6], offset, *args[6:], window, group, mark_valid=mark)
            for a, b in zip(got, expected, strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.dtype == b.dtype and a.shape == b.shape
                    assert torch.equal(a, b), (dtype, mark)
            assert torch.equal(valid, expected_valid)


def test_dispatch_on_cpu_is_the_reference() -> None:
    args = _inputs(torch.device("cpu"), torch.float32, learned=False)
    got = decode_inputs(*args[:6], 0, *args[6:], None, 2)
    expected = reference(*args[:6], 0, *args[6:], None, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))  # type: ignore[arg-type]
