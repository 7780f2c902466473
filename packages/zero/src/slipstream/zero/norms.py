"""Global gradient norm, clipping and the fp16 overflow vote over sharded gradients."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from slipstream.kernels.loss_scaler import inf_or_nan_flag
from slipstream.zero.group import DataParallelGroup

__all__ = [
    "clip_coefficient",
    "clip_grads_",
    "global_grad_norm",
    "local_squares",
    "norm_of_squares",
    "overflow_on_any_rank",
    "unscale_factor",
]


def local_squares(shard_grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's sum of squares of ``shard_grads`` (fp32 scalar on ``device``).

    Host shards (CPU offload, some or all of them) are summed there; the result lives on the
    device, where the collective runs. An inf or nan in any gradient makes it non-finite.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in shard_grads:
        by_device.setdefault(grad.device, []).append(grad)
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grads in by_device.values():
        # One multi-tensor pass per device, accumulating in fp32 (a square, a sum and their
        # temporaries per tensor before: three passes and hundreds of small kernels per step).
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        squares = squares + torch.stack(norms).square().sum().to(device)
    return squares


def global_grad_norm(
    shard_grads: Sequence[torch.Tensor], group: DataParallelGroup, device: torch.device
) -> torch.Tensor:
    """The L2 norm of the whole (unsharded) gradient from each rank's shards.

    Each rank sums the squares of its own shards; one scalar all-reduce adds them up. Padding
    elements of a shard are zero (they are reduced zeros), so they add nothing; a tied
    parameter has one master, so it is counted once.
    """
    squares = local_squares(shard_grads, device)
    group.sum_(squares)
    return squares.sqrt()


def clip_grads_(
    shard_grads: Sequence[torch.Tensor], total_norm: torch.Tensor, max_norm: float
) -> None:
    """Scale the gradients so the global norm is at most ``max_norm`` (torch's coefficient)."""
    if not shard_grads or max_norm <= 0 or math.isinf(max_norm):
        return
    coefficient = clip_coefficient(total_norm, max_norm)
    torch._foreach_mul_(list(shard_grads), coefficient.to(shard_grads[0].device))


def unscale_factor(loss_scale: float | None) -> float:
    """The factor that undoes an fp16 loss scale (1.0 without one). Every step path and the
    speculative step take it from here, so that their factors compare equal bit for bit."""
    return 1.0 / loss_scale if loss_scale not in (None, 1.0) else 1.0


def norm_of_squares(total_squares: torch.Tensor, loss_scale: float | None) -> torch.Tensor:
    """The unscaled global norm from the all-reduced sum of squares of scaled gradients."""
    norm = total_squares.sqrt()
    return norm / loss_scale if loss_scale not in (None, 1.0) else norm


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor: ``max / (norm + 1e-6)``, clamped at 1 (fp32)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def overflow_on_any_rank(
    shard_grads: Sequence[torch.Tensor], group: DataParallelGroup, device: torch.device
) -> bool:
    """Whether any rank's gradient shard holds an inf or nan; every rank gets the same answer.

    With sharded gradients no rank sees them all, so the local flags are max-reduced: all
    ranks then skip (or take) the step together and their loss scales stay equal.
    """
    flag = inf_or_nan_flag(shard_grads)
    if flag is None:
        flag = torch.zeros((), dtype=torch.float32, device=device)
    flag = flag.to(device)
    group.max_(flag)
    return bool(flag.item())  # host sync: the step must know now whether to skip
