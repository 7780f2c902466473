"""One Triton kernel for a tensor-parallel block's sum, residual add and RMSNorm over NVLink P2P.

A decode step of a tensor-parallel decoder ends each branch with three dependent pieces: the
all-reduce of the row-parallel partial outputs, the residual add, and the next RMSNorm. Done
apart they are two kernels (the symmetric-memory one-shot sum, then ``add_rms_norm``) with two
barriers across the GPUs inside the first. :func:`reduce_add_rms_norm` does all three in one
kernel with one cross-GPU round trip:

[Note: the protocol of the fused kernel]
Every rank holds a symmetric buffer (``torch.distributed._symmetric_memory``: every rank of the
group has mapped every other rank's) and a signal pad of ``int32`` flags. Program ``b`` of the
grid (the same ``NB`` programs on every rank, whatever the number of rows; rows ``b, b + NB, ...``
are program ``b``'s) keeps two flags per peer ``p`` in this rank's pad, at
``(b * 2 + kind) * world + p``:

- ``READY`` (kind 0): peer ``p`` has written its rows of program ``b`` into its buffer;
- ``DONE`` (kind 1): peer ``p`` has finished reading this rank's rows of program ``b``
  (set to 1 at setup: nothing to read yet).

A call on program ``b``: (1) wait for ``DONE`` from every peer (the previous call's reads of this
rank's buffer are over; in practice long set, a GEMV ago), consuming it; (2) copy this rank's
partial rows into its own buffer; (3) set ``READY`` at every peer (release, system scope); (4)
wait for every peer's ``READY`` (acquire), consuming it; (5) sum the rows of all ranks in rank
order (fp32, so every rank gets the same bits), add the residual, write the new residual and its
RMSNorm; (6) set ``DONE`` at every peer. A flag is never set twice before it is consumed, so one
buffer serves every call, in eager steps and in CUDA-graph replays alike, with one round trip a
call instead of the two barriers of a copy-in/copy-out one-shot all-reduce. Waits give up after
``MAX_SPIN`` polls and raise the error flag (checked by the setup probe), so a broken peer cannot
hang a process forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "MAX_BLOCKS",
    "MAX_COLUMNS",
    "SymmNormState",
    "all_reduce_sum",
    "reduce_add_rms_norm",
    "reference",
    "reference_sum",
]

MAX_BLOCKS = 32  # programs per call (rows are dealt round-robin over them)
MAX_COLUMNS = 16384  # a row lives in registers
MAX_SPIN = 1 << 24  # polls of a flag before a wait gives up (seconds, far beyond any real wait)
_READY, _DONE = 0, 1


def reference(
    partials: Sequence[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's math in torch: ``total = round(sum(partials) + residual)`` (the sum
    in fp32, in rank order) and ``rms_norm(total) * weight`` (fp32, rounded once)."""
    acc = partials[0].float()
    for part in partials[1:]:
        acc = acc + part.float()
    total = (acc + residual.float()).to(residual.dtype)
    t = total.float()
    normed = t * (1.0 / torch.sqrt((t * t).mean(-1, keepdim=True) + eps))
    if weight is not None:
        normed = normed * weight.float()
    return total, normed.to(residual.dtype)


def reference_sum(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`all_reduce_sum`'s math in torch: the fp32 sum in rank order, rounded once."""
    acc = partials[0].float()
    for part in partials[1:]:
        acc = acc + part.float()
    return acc.to(partials[0].dtype)


def _kernel() -> Any:
    """The ``@triton.jit`` kernel, imported on first use (this module imports without Triton;
    Triton reads ``TRITON_INTERPRET`` when the kernel module is imported)."""
    from slipstream.inference.allreduce_norm_triton import reduce_add_rms_norm_kernel

    return reduce_add_rms_norm_kernel


class SymmNormState:
    """What the fused kernel needs of one group's symmetric memory (built by the reducer's
    setup, or by a test that lays the buffers out itself).

    Attributes:
        buffer: this rank's symmetric buffer (flat; rows of a call are laid out from its start).
        buffer_ptrs / pad_ptrs: int64 device tensors, every rank's buffer / signal pad address.
        pad: this rank's signal pad as int32 flags (at least ``blocks * 2 * world``).
        error: int32 ``(1,)``, set by the kernel when a wait gave up.
        blocks: programs per call, the same on every rank.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        buffer_ptrs: torch.Tensor,
        pad_ptrs: torch.Tensor,
        pad: torch.Tensor,
        rank: int,
        world: int,
        blocks: int,
    ) -> None:
        if pad.numel() < blocks * 2 * world:
            raise ValueError(f"signal pad of {pad.numel()} flags < {blocks} x 2 x {world}")
        self.buffer, self.buffer_ptrs, self.pad_ptrs, self.pad = buffer, buffer_ptrs, pad_ptrs, pad
        self.rank, self.world, self.blocks = rank, world, blocks
        self.error = torch.zeros(1, dtype=torch.int32, device=buffer.device)
        self.spin = MAX_SPIN  # polls before a wait gives up (tests shorten it)

    def reset_flags(self) -> None:
        """This rank's flags to the start state (``DONE`` set for every peer, ``READY`` clear).

        Every rank must do it, and synchronize with the others, before the first call.
        """
        flags = self.pad[: self.blocks * 2 * self.world].view(self.blocks, 2, self.world)
        flags.zero_()
        flags[:, _DONE] = 1
        flags[:, _DONE, self.rank] = 0

    def fits(self, partial: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether the kernel takes these tensors (else the caller sums and norms apart)."""
        if residual is not None and (
            residual.dtype != partial.dtype or residual.shape != partial.shape
        ):
            return False
        return (
            partial.dtype == self.buffer.dtype
            and partial.device == self.buffer.device
            and 0 < partial.shape[-1] <= MAX_COLUMNS
            and partial.numel() <= self.buffer.numel()
        )


def _launch(
    state: SymmNormState,
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from slipstream.kernels.triton_support import next_power_of_2

    partial = partial.contiguous()
    columns = partial.shape[-1]
    out = torch.empty_like(partial)
    total = torch.empty_like(partial) if residual is not None else out
    if residual is not None:
        residual = residual.contiguous()
    _kernel()[(state.blocks,)](
        partial,
        residual if residual is not None else partial,
        weight if weight is not None else partial,
        total,
        out,
        state.buffer_ptrs,
        state.pad_ptrs,
        state.error,
        partial.numel() // columns,
        columns,
        eps,
        RANK=state.rank,
        WORLD=state.world,
        NORM=residual is not None,
        HAS_WEIGHT=weight is not None,
        BLOCK=max(16, next_power_of_2(columns)),
        SPIN=state.spin,
        num_warps=8 if columns >= 4096 else 4,
    )
    return total, out


def reduce_add_rms_norm(
    state: SymmNormState,
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, rms_norm(total) * weight)`` with ``total = residual + sum of every rank's
    partial``, in one kernel (see the note above); every rank of the group must call it (or
    :func:`all_reduce_sum`) with tensors of the same shape, in the same order. Check
    :meth:`SymmNormState.fits` first."""
    return _launch(state, partial, residual, weight, eps)


def all_reduce_sum(state: SymmNormState, partial: torch.Tensor) -> torch.Tensor:
    """Every rank's ``partial`` summed (fp32, in rank order, rounded once), in one kernel with
    one round trip between the GPUs. Check :meth:`SymmNormState.fits` first."""
    return _launch(state, partial, None, None, 0.0)[1]
