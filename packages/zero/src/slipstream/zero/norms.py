"""Global gradient norm, clipping and the fp16 overflow vote over sharded gradients."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slipstream.kernels.loss_scaler import inf_or_nan_flag
from slipstream.zero.group import DataParallelGroup

__all__ = [
    "LandedSquares",
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
        squares = squares + squares_of_norms(tensor_norms(grads), device)
    return squares


def tensor_norms(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm in fp32, in one multi-tensor pass (what :func:`local_squares`
    takes; a tensor's norm does not depend on the others in the list)."""
    return list(torch._foreach_norm(list(grads), 2.0, dtype=torch.float32))


def squares_of_norms(norms: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares from per-tensor norms, exactly as :func:`local_squares` adds them."""
    return torch.stack(list(norms)).square().sum().to(device)


@dataclass(frozen=True, slots=True)
class LandedSquares:
    """This rank's sum of squares of its master gradients, taken by the reducer as the last
    reduction before a step landed (while the last reduce-scatter was still in flight), so
    that the step does not take it after backward. ``total`` equals :func:`local_squares` of
    ``grads`` bit for bit (the same per-tensor norms, added in the same order); it is valid
    only while the gradients are these tensors, unchanged (:meth:`covers`)."""

    total: torch.Tensor
    grads: tuple[torch.Tensor, ...]
    versions: tuple[int, ...]

    @classmethod
    def of(cls, total: torch.Tensor, grads: Sequence[torch.Tensor]) -> LandedSquares:
        """Record ``total`` for ``grads`` as they are now."""
        return cls(total, tuple(grads), tuple(g._version for g in grads))

    def covers(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether ``grads`` are the recorded tensors, not changed in place since."""
        return len(grads) == len(self.grads) and all(
            g is r and g._version == v for g, r, v in zip(grads, self.grads, self.versions)
        )


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
