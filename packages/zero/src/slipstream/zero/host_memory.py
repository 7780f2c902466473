"""HostArena: page-locked host tensors of exact size, carved from a few large blocks.

PyTorch's pinned-memory allocator rounds every request up to the next power of two (before
torch 2.13's ``pinned_max_round_threshold_mb``, always), so one pinned tensor per parameter
shard costs up to twice its size: a 13b model's fp32 masters (52 GB) took about 88 GB of
page-locked memory that way. Offload keeps masters, gradients and model-dtype copies in
pinned memory for the whole run, so the arena asks the allocator for blocks whose size is
already a power of two and hands out aligned, exact-size views of them (first fit over the
blocks' free tails). A block lives as long as any view of it.

The arena never reuses space: it is for tensors allocated once that live as long as it does
(allocating from it every step would grow it without bound). Tensors whose storage is resized
later (NVMe swapping frees and re-allocates storages) must not come from an arena either: they
need a storage of their own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

__all__ = ["HostArena"]

_ALIGN = 4096  # page-aligned views: O_DIRECT-ready, and no two tensors share a cache line
_MIN_BLOCK = 1 << 16
_MAX_BLOCK = 1 << 30


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(slots=True)
class _Block:
    data: torch.Tensor  # uint8, its whole (power-of-two) storage
    used: int = 0


class HostArena:
    """Host tensors for offload, page-locked when ``pin`` and a GPU is present.

    Args:
        pin: Page-lock the memory (asynchronous device copies). Without it, or without CUDA,
            :meth:`empty` is a plain ``torch.empty`` (already exact).
        expected_bytes: About how much will be asked for; sizes the blocks (a power of two
            between 64 KiB and 1 GiB), so a small model does not lock a whole GiB.
    """

    def __init__(self, pin: bool, expected_bytes: int = 0) -> None:
        self.pin = pin and torch.cuda.is_available()
        self.block_bytes = min(_MAX_BLOCK, max(_MIN_BLOCK, _pow2_ceil(max(expected_bytes, 1))))
        self._blocks: list[_Block] = []
        self.requested_bytes = 0
        # The CPU-step worker may allocate while the main thread does (during backward).
        self._lock = threading.Lock()

    @property
    def reserved_bytes(self) -> int:
        """Page-locked bytes held in blocks."""
        return sum(b.data.numel() for b in self._blocks)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of ``shape`` and ``dtype`` (a view into a block when
        pinned; its ``data_ptr()`` is then 4096-aligned)."""
        numel = 1
        for dim in shape:
            numel *= int(dim)
        if not self.pin or numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        span = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            self.requested_bytes += nbytes
            block = next((b for b in self._blocks if b.data.numel() - b.used >= span), None)
            if block is None:
                block = _Block(self._new_block(max(self.block_bytes, _pow2_ceil(span))))
                self._blocks.append(block)
            start = block.used
            block.used += span
        return block.data[start : start + nbytes].view(dtype).view(shape)

    def _new_block(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (a power of two) of page-locked memory, which the allocator gives at
        exactly that size."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def __repr__(self) -> str:
        return (
            f"HostArena(pin={self.pin}, blocks={len(self._blocks)}, "
            f"reserved={self.reserved_bytes:,}, requested={self.requested_bytes:,})"
        )
