"""``decode_inputs``: the reference against the decoder's own prologue ops, the Triton kernel
against the reference bit for bit (GQA and MHA, sliding window, learned positions, no rotary,
batch 2 with left padding, fp32 / fp16 / bf16, the key-valid write)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.ops import decode_inputs
from slipstream.kernels.ops.decode_inputs.reference import decode_inputs as reference
from slipstream.kernels.ops.rms_norm.reference import rms_norm

VOCAB, HIDDEN, KEYS, HALF = 50, 24, 40, 4


def _tables(length: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half)))
    angles = torch.arange(length)[..., None].float() * inv_freq.float()
    return angles.cos(), angles.sin()


def _inputs(
    device: torch.device, dtype: torch.dtype, learned: bool, slot: int = 17, hidden: int = HIDDEN
):
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 7], [2, 41]])[:, 1:]  # a strided view, as a prompt's last column
    pads = torch.tensor([0, 5])  # row 1 is left-padded: its first five slots hold no token
    positions = (slot - pads)[:, None]
    key_valid = torch.zeros(2, KEYS, dtype=torch.bool)
    for row, pad in enumerate(pads.tolist()):
        key_valid[row, pad:slot] = True
    key_valid[1, 3] = True  # stale flags after the slot and inside padding must not leak
    key_valid[0, slot + 4] = True
    embed = torch.randn(VOCAB, hidden, generator=generator)
    position_weight = torch.randn(slot + 8, hidden, generator=generator) if learned else None
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
    norm_w = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x, cos, sin, mask, normed = reference(
        ids, positions, valid, slots, embed, pos_w, 2, cos_t, sin_t, 6, 3, norm_weight=norm_w
    )
    assert torch.equal(valid, before)  # mark_valid off: key_valid untouched
    assert normed is not None and torch.equal(normed, rms_norm(x, norm_w, 1e-6))
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
    triton_device: torch.device,
    learned: bool,
    window: int | None,
    group: int,
    rotary: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slipstream.kernels.ops.decode_inputs import triton as triton_module
    from slipstream.kernels.ops.decode_inputs.triton import decode_inputs as kernel

    if window is not None:  # three mask chunks a row: six programs arrive on the counter
        monkeypatch.setattr(triton_module, "BLOCK_KEYS", 16)

    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    for dtype in dtypes:
        args = list(_inputs(triton_device, dtype, learned))
        if not rotary:
            args[6] = args[7] = None
        args[1] = args[1].contiguous()  # positions advance in place with next_slot
        offset = 2 if learned else 0
        for mark, advance in ((False, False), (True, False), (True, True)):
            # advance: the slot comes from next_slot (17) into slots (0 here), then positions
            # and next_slot step by one; twice, so the kernel's arrival counter is reused
            mine = [a if a is None else a.clone() for a in args]
            theirs = [a if a is None else a.clone() for a in args]
            if advance:
                mine[3], theirs[3] = torch.zeros_like(args[3]), torch.zeros_like(args[3])
            nexts = [args[3].clone() if advance else None for _ in range(2)]
            for _ in range(2 if advance else 1):
                expected = reference(
                    *theirs[:6],
                    offset,
                    *theirs[6:],
                    window,
                    group,
                    mark_valid=mark,
                    next_slot=nexts[0],
                )
                got = kernel(
                    *mine[:6],
                    offset,
                    *mine[6:],
                    window,
                    group,
                    mark_valid=mark,
                    next_slot=nexts[1],
                )
                assert got[4] is None and expected[4] is None
                for a, b in zip(got[:4], expected[:4], strict=True):
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert a.dtype == b.dtype and a.shape == b.shape
                        assert torch.equal(a, b), (dtype, mark, advance)
                for a, b in zip(mine[:4], theirs[:4], strict=True):  # ids, positions, valid, slots
                    assert torch.equal(a, b), (dtype, mark, advance)
                if advance:
                    assert torch.equal(nexts[0], nexts[1])
            if advance:
                assert int(nexts[1]) == int(args[3]) + 2 and int(mine[3]) == int(args[3]) + 1
                assert torch.equal(mine[1], args[1] + 2)


def test_dispatch_on_cpu_is_the_reference() -> None:
    args = _inputs(torch.device("cpu"), torch.float32, learned=False)
    got = decode_inputs(*args[:6], 0, *args[6:], None, 2)
    expected = reference(*args[:6], 0, *args[6:], None, 2)
    assert got[4] is None and expected[4] is None
    assert all(torch.equal(a, b) for a, b in zip(got[:4], expected[:4], strict=True))  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [1, 2])
def test_first_norm_is_rms_norms_own(triton_device: torch.device, batch: int) -> None:
    """With the first block's RMSNorm: at batch 1 it runs in the launch (rms_norm's own code
    inlined, one row a program), at batch 2 (rms_norm packs two rows of 24 a program) as the
    rms_norm op's launch; either way the Triton rms_norm's bits. On a GPU also at 8B Llama's
    width (4096: one row a program with 8 warps at batch 1 and 2)."""
    from slipstream.kernels.ops.decode_inputs.triton import decode_inputs as kernel
    from slipstream.kernels.ops.rms_norm.triton import rms_norm as triton_rms_norm

    widths = [HIDDEN] + ([4096] if triton_device.type == "cuda" else [])
    for dtype, hidden in [(d, h) for d in (torch.float32, torch.bfloat16) for h in widths]:
        args = [
            a[:batch].contiguous() if a is not None and i < 3 else a
            for i, a in enumerate(_inputs(triton_device, dtype, False, hidden=hidden))
        ]
        weight = torch.randn(hidden, generator=torch.Generator().manual_seed(1)).to(
            triton_device, dtype
        )
        theirs = [a if a is None else a.clone() for a in args]
        nexts = [args[3].clone(), args[3].clone()]  # and advancing: batch 1 is one program
        got = kernel(
            *args[:6], 0, *args[6:], None, 2, next_slot=nexts[0], norm_weight=weight, norm_eps=1e-5
        )
        expected = reference(
            *theirs[:6],
            0,
            *theirs[6:],
            None,
            2,
            next_slot=nexts[1],
            norm_weight=weight,
            norm_eps=1e-5,
        )
        assert all(torch.equal(a, b) for a, b in zip(got[:4], expected[:4], strict=True))  # type: ignore[arg-type]
        assert torch.equal(nexts[0], nexts[1]) and torch.equal(args[1], theirs[1])
        assert got[4] is not None and expected[4] is not None
        assert torch.equal(got[4], triton_rms_norm(got[0], weight, 1e-5)), (batch, dtype, hidden)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # the interpreter's bf16 casts truncate
        torch.testing.assert_close(got[4], expected[4], rtol=tol, atol=tol)
