"""A differentiable all-to-all over the expert-parallel group, through comm's logged collective."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream import comm

__all__ = ["all_to_all"]


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the same all-to-all of the gradient
    (chunk ``j`` went to rank ``j``, so rank ``j``'s gradient chunk comes back from it)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, group: dist.ProcessGroup | None, log_name: str, tensor: torch.Tensor
    ) -> torch.Tensor:
        ctx.group = group
        ctx.log_name = log_name
        tensor = tensor.contiguous()
        output = torch.empty_like(tensor)
        comm.all_to_all_single(output, tensor, group=group, log_name=log_name)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, None, torch.Tensor]:  # type: ignore[override]
        grad = _AllToAll.apply(ctx.group, f"{ctx.log_name}_backward", grad_output)
        return None, None, grad


def all_to_all(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, log_name: str = "moe_all_to_all"
) -> torch.Tensor:
    """Split `tensor` into ``world_size(group)`` equal chunks along dim 0, send chunk ``j`` to
    rank ``j`` and concatenate what arrives, in rank order; differentiable.

    Recorded by the comms logger under `log_name` (and ``<log_name>_backward``). The size of
    dim 0 must be a multiple of the group size and every rank must pass the same shape.
    """
    group_size = comm.get_world_size(group)
    if tensor.shape[0] % group_size:
        raise ValueError(
            f"all_to_all: dim 0 ({tensor.shape[0]}) is not a multiple of the group size "
            f"{group_size}"
        )
    result: torch.Tensor = _AllToAll.apply(group, log_name, tensor)
    return result
