"""Pure-torch decode-step prologue: embedding, rotary cos/sin from a table, additive mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.kernels.ops.rms_norm.reference import rms_norm


def check_shapes(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    slots: torch.Tensor,
    embed_weight: torch.Tensor,
    position_weight: torch.Tensor | None,
    cos_table: torch.Tensor | None,
    sin_table: torch.Tensor | None,
    group: int,
    next_slot: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
) -> None:
    """Validate the arguments of :func:`decode_inputs`."""
    batch = input_ids.shape[0]
    if input_ids.dim() != 2 or input_ids.shape[1] != 1:
        raise ValueError(
            f"decode_inputs: input_ids must be (batch, 1), one token per row, got "
            f"{tuple(input_ids.shape)}"
        )
    if positions.shape != input_ids.shape:
        raise ValueError(
            f"decode_inputs: positions must be (batch {batch}, 1), got {tuple(positions.shape)}"
        )
    if key_valid.dim() != 2 or key_valid.shape[0] != batch or key_valid.dtype != torch.bool:
        raise ValueError(
            f"decode_inputs: key_valid must be bool (batch {batch}, keys), got "
            f"{key_valid.dtype} {tuple(key_valid.shape)}"
        )
    if slots.shape != (1,):
        raise ValueError(f"decode_inputs: slots must be (1,), got {tuple(slots.shape)}")
    if embed_weight.dim() != 2:
        raise ValueError(
            f"decode_inputs: embed_weight must be (vocab, hidden), got {tuple(embed_weight.shape)}"
        )
    if position_weight is not None and (
        position_weight.shape[1:] != embed_weight.shape[1:]
        or position_weight.dtype != embed_weight.dtype
    ):
        raise ValueError(
            f"decode_inputs: position_weight must be (positions, {embed_weight.shape[1]}) "
            f"{embed_weight.dtype}, got {position_weight.dtype} {tuple(position_weight.shape)}"
        )
    if (cos_table is None) != (sin_table is None):
        raise ValueError("decode_inputs: pass both cos_table and sin_table, or neither")
    if cos_table is not None and (
        cos_table.dim() != 2
        or sin_table is None
        or sin_table.shape != cos_table.shape
        or cos_table.dtype != torch.float32
        or sin_table.dtype != torch.float32
    ):
        raise ValueError(
            "decode_inputs: cos_table and sin_table must be fp32 (positions, rotary_dim / 2) "
            f"alike, got {cos_table.dtype} {tuple(cos_table.shape)} and "
            f"{None if sin_table is None else (sin_table.dtype, tuple(sin_table.shape))}"
        )
    if group < 1:
        raise ValueError(f"decode_inputs: group must be >= 1, got {group}")
    if norm_weight is not None and norm_weight.shape != embed_weight.shape[1:]:
        raise ValueError(
            f"decode_inputs: norm_weight must be ({embed_weight.shape[1]},), got "
            f"{tuple(norm_weight.shape)}"
        )
    if next_slot is not None and (
        next_slot.shape != (1,) or not positions.is_contiguous() or next_slot.dtype != slots.dtype
    ):
        raise ValueError(
            f"decode_inputs: next_slot must be ({slots.dtype}) of shape (1,) and positions "
            f"contiguous (both advance in place), got {next_slot.dtype} "
            f"{tuple(next_slot.shape)} and positions strides {positions.stride()}"
        )


def decode_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    key_valid: torch.Tensor,
    slots: torch.Tensor,
    embed_weight: torch.Tensor,
    position_weight: torch.Tensor | None,
    position_offset: int,
    cos_table: torch.Tensor | None,
    sin_table: torch.Tensor | None,
    sliding_window: int | None,
    group: int,
    mark_valid: bool = False,
    next_slot: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None
]:
    """The inputs of a single-token decode step's first block, as a decoder computes them.

    Args:
        input_ids: ``(batch, 1)`` token ids; ``positions`` ``(batch, 1)`` their position ids.
        key_valid: bool ``(batch, keys)``: which cache slots hold real tokens. With
            ``mark_valid`` the query's slot is set valid in place, for every row.
        slots: ``(1,)`` the cache slot the tokens are written to.
        embed_weight: ``(vocab, hidden)`` token embedding; ``position_weight`` the learned
            position embedding ``(positions, hidden)`` read at ``positions + position_offset``
            (None: rotary or no positions).
        cos_table, sin_table: fp32 ``(table_positions, rotary_dim / 2)``, row ``p`` the rotary
            cos/sin of position ``p`` (None: no rotary).
        sliding_window: keys more than this many slots before the query are masked (None: all).
        group: query heads per KV head; the mask's rows are repeated this many times.
        next_slot: ``(1,)``, for a step replayed from a CUDA graph step after step: the slot is
            read from it and written to ``slots``, then ``positions`` and ``next_slot`` each
            advance by one in place (the next step's), so nothing is copied in before a replay.
        norm_weight, norm_eps: the first block's RMSNorm, applied to ``x`` as the ``rms_norm``
            op does (None: not applied).

    Returns ``(x, cos, sin, mask, normed)``: ``x`` ``(batch, 1, hidden)`` (embedding plus learned
    position, rounded to the embedding's dtype as torch adds them), ``cos``/``sin`` fp32
    ``(batch, 1, 1, rotary_dim / 2)`` (None without tables) and the additive mask
    ``(batch, 1, group, keys)`` (0 where the query sees the key, ``-inf`` elsewhere, in the
    embedding's dtype): a query at slot ``q`` sees the valid keys at ``k <= q`` (within the
    window) and always itself; ``normed`` is ``rms_norm(x, norm_weight, norm_eps)`` (None
    without ``norm_weight``).
    """
    check_shapes(
        input_ids,
        positions,
        key_valid,
        slots,
        embed_weight,
        position_weight,
        cos_table,
        sin_table,
        group,
        next_slot,
        norm_weight,
    )
    if next_slot is not None:
        slots.copy_(next_slot)
    if mark_valid:
        key_valid.index_fill_(1, slots, True)
    x = F.embedding(input_ids, embed_weight)
    if position_weight is not None:
        x = x + F.embedding(positions + position_offset, position_weight)
    cos = sin = None
    if cos_table is not None and sin_table is not None:
        cos, sin = cos_table[positions][:, :, None], sin_table[positions][:, :, None]
    key_slots = torch.arange(key_valid.shape[1], device=key_valid.device)
    causal = key_slots[None, :] <= slots[:, None]
    if sliding_window is not None:
        causal = causal & (slots[:, None] - key_slots[None, :] < sliding_window)
    allowed = causal[None] & key_valid[:, None, :]
    allowed = (allowed | (key_slots[None, :] == slots[:, None])[None])[:, None]
    if group > 1:
        allowed = allowed[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)
    mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device)
    if next_slot is not None:  # after every read of this step's positions and slot
        positions.add_(1)
        next_slot.add_(1)
    normed = None if norm_weight is None else rms_norm(x, norm_weight, norm_eps)
    return x, cos, sin, mask.masked_fill_(~allowed, float("-inf")), normed
