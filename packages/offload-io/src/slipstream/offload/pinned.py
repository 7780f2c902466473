"""Aligned (and pinned) host buffers for swap I/O.

O_DIRECT transfers need buffer addresses aligned to the device's logical block (4096 covers
every NVMe drive), and GPU copies are only asynchronous from page-locked ("pinned") memory.
torch gives neither guarantee for a plain ``torch.empty``, so :func:`aligned_empty`
over-allocates and views an aligned slice, and :class:`PinnedBufferPool` keeps a fixed set of
such buffers for reuse: pinning is slow (it locks pages in the kernel) and pinned memory is a
scarce resource, so a swap tier allocates its staging buffers once and cycles them.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["PinnedBufferPool", "aligned_empty"]


def aligned_empty(
    numel: int, dtype: torch.dtype, *, alignment: int = 4096, pin: bool = False
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose ``data_ptr()`` is a multiple of ``alignment``.

    Args:
        numel: Elements of ``dtype``.
        dtype: Element type.
        alignment: Address alignment in bytes (a power of two, at least the element size).
        pin: Page-lock the memory when CUDA is available (for asynchronous device copies);
            without CUDA the memory is plain (pinning needs a CUDA context), with no error.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if alignment % itemsize:
        raise ValueError(f"alignment {alignment} is not a multiple of the {dtype} size {itemsize}")
    nbytes = numel * itemsize
    pin_memory = pin and torch.cuda.is_available()
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin_memory)
    start = -raw.data_ptr() % alignment
    # The slice keeps `raw`'s storage alive, so the aligned view outlives this function.
    return raw[start : start + nbytes].view(dtype)


class PinnedBufferPool:
    """A fixed set of aligned (pinned when CUDA is available) uint8 buffers, reused.

    ``acquire`` blocks until a buffer is free (so the pool also bounds the staging memory in
    flight); ``release`` gives it back. Thread-safe.
    """

    def __init__(self, count: int, nbytes: int, *, pin: bool = False, alignment: int = 4096):
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if nbytes < 1:
            raise ValueError(f"nbytes must be >= 1, got {nbytes}")
        self._count = count
        self._nbytes = nbytes
        self._buffers = [
            aligned_empty(nbytes, torch.uint8, alignment=alignment, pin=pin) for _ in range(count)
        ]
        self._owned = {buffer.data_ptr(): buffer for buffer in self._buffers}
        self._free = list(self._buffers)
        self._free_ptrs = set(self._owned)
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        """Buffers in the pool."""
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes per buffer."""
        return self._nbytes

    def available(self) -> int:
        """Buffers free right now."""
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        """A free buffer (uint8, ``nbytes`` long); waits up to ``timeout`` seconds (forever if
        ``None``) for one to be released.

        Raises:
            TimeoutError: No buffer was released in time (all ``count`` are in use: release
                buffers after their I/O, or make the pool larger).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout):
                raise TimeoutError(
                    f"no free buffer in the pool of {self._count} × {self._nbytes:,} bytes after "
                    f"{timeout} s: every buffer is still acquired; release buffers once their "
                    "I/O has finished, or create the pool with a larger count"
                )
            buffer = self._free.pop()
            self._free_ptrs.discard(buffer.data_ptr())
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back to the pool.

        Raises:
            ValueError: ``buffer`` was not acquired from this pool, or is released twice.
        """
        ptr = buffer.data_ptr()
        with self._cond:
            owned = self._owned.get(ptr)
            if owned is None or buffer.numel() != owned.numel() or buffer.dtype != owned.dtype:
                raise ValueError("release(): this buffer was not acquired from this pool")
            if ptr in self._free_ptrs:
                raise ValueError("release(): this buffer is already released (released twice)")
            self._free.append(owned)
            self._free_ptrs.add(ptr)
            self._cond.notify()
