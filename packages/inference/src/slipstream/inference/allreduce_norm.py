"""One Triton kernel for a tensor-parallel block's sum, residual add and RMSNorm over NVLink P2P.

A decode step of a tensor-parallel decoder ends each branch with three dependent pieces: the
all-reduce of the row-parallel partial outputs, the residual add, and the next RMSNorm. Done
apart they are two kernels (torch's symmetric-memory one-shot sum, then ``add_rms_norm``), and
the one-shot sum alone crosses NVLink several times (a barrier before the peers' loads, the
loads, a barrier after). :func:`reduce_add_rms_norm` does all three in one kernel that crosses
NVLink once, one way; :func:`all_reduce_sum` is the same kernel without the add and norm.

[Note: the push protocol of the TP kernel]
Every rank holds a receive buffer in symmetric memory (``torch.distributed._symmetric_memory``:
every rank has mapped every other rank's) of 8-byte slots, in regions ``(parity, sender)``.
Program ``b`` of the grid (the same ``NB`` programs on every rank whatever the number of rows;
rows ``b, b + NB, ...`` are program ``b``'s) counts its calls in this rank's ``epochs[b]``; all
ranks make the same calls, so call ``e`` has the same number everywhere. A call: (1) each 32-bit
word of this rank's partial rows is stored, beside ``e`` in the high half of one 8-byte slot,
into region ``(e % 2, this rank)`` of every peer's buffer; (2) for each peer, this rank polls its
own region ``(e % 2, peer)`` until every slot of its rows carries ``e`` (an 8-byte store is seen
whole or not at all, so the number vouches for the word: no fence, no separate flag, no
barrier), then sums the ranks' rows in rank order in fp32 (the same bits on every rank), adds
the residual and normalizes. Two regions per sender suffice: a peer writes call ``e + 2`` only
after it has received this rank's call ``e + 1``, which this rank sends after it has finished
reading call ``e``. Old words never pass for new ones (their number is older). A poll gives up
after ``MAX_SPIN`` tries and raises the error flag (checked by the setup probe), so a missing
peer cannot hang a process forever. Words pack two bf16 or one fp32.
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
MAX_SPIN = 1 << 26  # polls before a wait gives up (about a minute: far beyond any real wait)
_DTYPES = (torch.bfloat16, torch.float32)  # words of two bf16 or one fp32


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
    """What the TP kernel needs of one group's symmetric memory (built by the reducer's setup,
    or by a test that lays the buffers out itself).

    Attributes:
        recv: this rank's receive buffer, int64 slots: ``2 * world`` regions of ``slot_words``.
        recv_ptrs: int64 device tensor, every rank's receive buffer address.
        epochs: int32 ``(blocks,)``, this rank's call count per program.
        error: int32 ``(1,)``, set by the kernel when a poll gave up.
        blocks: programs per call, the same on every rank.
    """

    def __init__(
        self, recv: torch.Tensor, recv_ptrs: torch.Tensor, rank: int, world: int, blocks: int
    ) -> None:
        if recv.dtype != torch.int64 or recv.numel() % (2 * world):
            raise ValueError("the receive buffer must hold int64 slots, 2 x world regions")
        self.recv, self.recv_ptrs = recv, recv_ptrs
        self.rank, self.world, self.blocks = rank, world, blocks
        self.slot_words = recv.numel() // (2 * world)
        self.epochs = torch.zeros(blocks, dtype=torch.int32, device=recv.device)
        self.error = torch.zeros(1, dtype=torch.int32, device=recv.device)
        self.spin = MAX_SPIN  # polls before a wait gives up (tests shorten it)

    def reset(self) -> None:
        """The start state: no call made, no word received. Every rank must do it, and
        synchronize with the others, before the first call."""
        self.recv.zero_()
        self.epochs.zero_()
        self.error.zero_()

    def fits(self, partial: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether the kernel takes these tensors (else the caller sums and norms apart)."""
        if residual is not None and (
            residual.dtype != partial.dtype or residual.shape != partial.shape
        ):
            return False
        columns = partial.shape[-1] if partial.dim() else 0
        return (
            partial.dtype in _DTYPES
            and partial.device == self.recv.device
            and 0 < columns <= MAX_COLUMNS
            and (columns * partial.element_size()) % 4 == 0
            and partial.numel() * partial.element_size() // 4 <= self.slot_words
        )


def _words(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _launch(
    state: SymmNormState,
    partial: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    from slipstream.kernels.triton_support import next_power_of_2

    partial = partial.contiguous()
    words = _words(partial)
    n_words = words.shape[-1]
    out = torch.empty_like(partial)
    total = torch.empty_like(partial) if residual is not None else out
    if weight is not None and weight.dtype != partial.dtype:
        weight = weight.to(partial.dtype)
    _kernel()[(state.blocks,)](
        words,
        _words(residual) if residual is not None else words,
        _words(weight) if weight is not None else words,
        total.view(torch.int32),
        out.view(torch.int32),
        state.recv_ptrs,
        state.epochs,
        state.error,
        words.numel() // n_words,
        n_words,
        state.slot_words,
        eps,
        RANK=state.rank,
        WORLD=state.world,
        PACKED=partial.element_size() == 2,
        NORM=residual is not None,
        HAS_WEIGHT=weight is not None,
        BLOCK=max(16, next_power_of_2(n_words)),
        SPIN=state.spin,
        num_warps=8 if n_words >= 2048 else 4,
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
    one one-way crossing between the GPUs. Check :meth:`SymmNormState.fits` first."""
    return _launch(state, partial, None, None, 0.0)[1]
