"""The ``decode_inputs`` op: a decode step's embedding, rotary cos/sin and additive mask at once."""

from __future__ import annotations

import torch

from slipstream.kernels.ops.backends import register_triton
from slipstream.kernels.registry import ANY_DEVICE, get_op, register_op

OP_NAME = "decode_inputs"

register_op(
    OP_NAME,
    "reference",
    "slipstream.kernels.ops.decode_inputs.reference:decode_inputs",
    device_types=(ANY_DEVICE,),
    priority=0,
)
register_triton(OP_NAME, "slipstream.kernels.ops.decode_inputs.triton:decode_inputs")

__all__ = ["OP_NAME", "decode_inputs"]


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
    *,
    mark_valid: bool = False,
    next_slot: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None
]:
    """Run the best ``decode_inputs`` backend: ``(x, cos, sin, mask, normed)`` of a one-token
    step.

    See :func:`slipstream.kernels.ops.decode_inputs.reference.decode_inputs`.

    >>> ids, valid = torch.tensor([[3]]), torch.tensor([[True, True, False]])
    >>> table = torch.zeros(4, 2)
    >>> x, cos, sin, mask, _ = decode_inputs(ids, torch.tensor([[1]]), valid, torch.tensor([1]),
    ...                                   torch.randn(8, 4), None, 0, table, table, None, 2)
    >>> mask.shape
    torch.Size([1, 1, 2, 3])
    """
    fn = get_op(OP_NAME, embed_weight.device.type, embed_weight.dtype)
    return fn(  # type: ignore[no-any-return]
        input_ids,
        positions,
        key_valid,
        slots,
        embed_weight,
        position_weight,
        position_offset,
        cos_table,
        sin_table,
        sliding_window,
        group,
        mark_valid=mark_valid,
        next_slot=next_slot,
        norm_weight=norm_weight,
        norm_eps=norm_eps,
    )
