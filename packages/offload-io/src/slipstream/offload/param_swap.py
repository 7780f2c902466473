"""ParamSwapStore: ZeRO-3 parameter shards in swap files, read into host memory around their use.

ZeRO-Infinity's parameter tier. Each registered tensor (a parameter's flat host shard) keeps
its identity for the whole run (the stage's ShardedParameter, the CPU step's copy targets and
the checkpoint code refer to it); swapping it out resizes its *storage* to zero bytes (as
:class:`~slipstream.offload.nvme.NvmeStateSwapper` does), swapping it in resizes the storage
back and reads the bytes from its swap file. The user of a tensor brackets each use:

    store.prefetch(shards)         # optional: start the reads early
    store.ensure(shards)           # resident when this returns
    ...                            # read (or write) them
    store.release(shards, dirty)   # dirty: written back first, then freed

A clean release frees the memory at once (the file already holds those bytes). A dirty
release starts the write and frees the memory once it has completed: checked without
blocking at every later call, and waited for in :meth:`ParamSwapStore.finish`. An
``ensure`` of a tensor whose dirty write is still in flight keeps it (its bytes are still
in memory) instead of reading it back.

Tensors that fit in the ``max_in_cpu`` element budget when registered (in registration
order) stay in host memory for good and get no swap file: every call is a no-op for them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slipstream.offload.aio.engine import IORequest
    from slipstream.offload.swap import SwapSpace

__all__ = ["ParamSwapStore"]

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Entry:
    key: str
    tensor: torch.Tensor
    kept: bool  # within max_in_cpu: always resident, no file
    resident: bool = True
    reading: IORequest | None = None
    writing: IORequest | None = None
    free_after_write: bool = False


class ParamSwapStore:
    """Host tensors backed by swap files in ``space`` (see the note at the top).

    Args:
        space: the swap folder (:class:`~slipstream.offload.swap.SwapSpace`); closed by
            :meth:`close`.
        max_in_cpu: elements of registered tensors that stay resident (never swapped).
    """

    def __init__(self, space: SwapSpace, max_in_cpu: int) -> None:
        if max_in_cpu < 0:
            raise ValueError(f"max_in_cpu={max_in_cpu} must be >= 0")
        self.space = space
        self.max_in_cpu = max_in_cpu
        self._budget = max_in_cpu
        self._entries: dict[int, _Entry] = {}  # by id(tensor)
        self._writing: list[_Entry] = []  # entries whose memory is freed when their write ends
        self._closed = False

    # ------------------------------------------------------------------ bookkeeping
    def _entry(self, tensor: torch.Tensor) -> _Entry:
        entry = self._entries.get(id(tensor))
        if entry is None or entry.tensor is not tensor:
            raise KeyError("tensor is not registered with this ParamSwapStore")
        return entry

    def _entries_of(self, tensors: Iterable[torch.Tensor]) -> list[_Entry]:
        return [e for e in (self._entry(t) for t in tensors) if not e.kept]

    def __contains__(self, tensor: object) -> bool:
        entry = self._entries.get(id(tensor))
        return entry is not None and entry.tensor is tensor

    @property
    def resident_numel(self) -> int:
        """Elements of registered tensors in host memory now (kept ones included)."""
        return sum(e.tensor.numel() for e in self._entries.values() if e.resident)

    def is_swapped(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes are only on disk now (its storage is freed)."""
        return not self._entry(tensor).resident

    # ------------------------------------------------------------------ registration
    def register(self, key: str, tensor: torch.Tensor) -> None:
        """Adopt ``tensor`` (a contiguous host tensor with a storage of its own) under ``key``.

        Within the ``max_in_cpu`` budget it stays resident for good; otherwise its bytes are
        written to a new swap file and its memory freed once the write completes.

        Raises:
            ValueError: a non-CPU or non-contiguous tensor, a view, or one registered twice.
            DiskFullError: the swap folder cannot hold it.
        """
        self._check_open()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("ParamSwapStore holds contiguous host tensors")
        if tensor in self:
            raise ValueError(f"tensor {key!r} is already registered")
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            raise ValueError(f"tensor {key!r} must own its whole storage (not a view)")
        numel = tensor.numel()
        if numel <= self._budget:
            self._budget -= numel
            self._entries[id(tensor)] = _Entry(key, tensor, kept=True)
            return
        self.space.allocate(key, numel, tensor.dtype)
        entry = _Entry(key, tensor, kept=False)
        self._entries[id(tensor)] = entry
        entry.writing = self.space.write(key, tensor)
        entry.free_after_write = True
        self._writing.append(entry)
        self._reap(block=False)

    # ------------------------------------------------------------------ swapping
    def _begin_read(self, entry: _Entry) -> None:
        if entry.resident:
            if entry.free_after_write:  # its dirty write is in flight: keep it instead
                entry.free_after_write = False
            return
        tensor = entry.tensor
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        entry.reading = self.space.read(entry.key, tensor)
        entry.resident = True

    @staticmethod
    def _finish_read(entry: _Entry) -> None:
        if entry.reading is not None:
            request, entry.reading = entry.reading, None
            request.wait()

    def prefetch(self, tensors: Iterable[torch.Tensor]) -> None:
        """Start reading ``tensors`` that are on disk (no waiting)."""
        self._check_open()
        self._reap(block=False)
        for entry in self._entries_of(tensors):
            self._begin_read(entry)

    def ensure(self, tensors: Iterable[torch.Tensor]) -> None:
        """Make ``tensors`` resident (reading the ones on disk; waiting for reads in flight)."""
        self._check_open()
        self._reap(block=False)
        entries = self._entries_of(tensors)
        for entry in entries:
            self._begin_read(entry)
        for entry in entries:
            self._finish_read(entry)

    def release(self, tensors: Iterable[torch.Tensor], dirty: bool) -> None:
        """Done with ``tensors`` for now: free their memory (``dirty``: after writing them back)."""
        self._check_open()
        for entry in self._entries_of(tensors):
            if not entry.resident:
                continue
            self._finish_read(entry)
            if dirty:
                if entry.writing is not None:  # two writes of one file must not overlap
                    request, entry.writing = entry.writing, None
                    request.wait()
                entry.writing = self.space.write(entry.key, entry.tensor)
                entry.free_after_write = True
                if entry not in self._writing:
                    self._writing.append(entry)
            elif entry.writing is not None:  # a write still reads the memory: free after it
                entry.free_after_write = True
                if entry not in self._writing:
                    self._writing.append(entry)
            else:
                self._free(entry)
        self._reap(block=False)

    @staticmethod
    def _free(entry: _Entry) -> None:
        entry.tensor.untyped_storage().resize_(0)
        entry.resident = False
        entry.free_after_write = False

    def _reap(self, block: bool) -> None:
        """Free the entries whose write has completed (all of them, waiting, with ``block``)."""
        still: list[_Entry] = []
        failed: BaseException | None = None
        for entry in self._writing:
            request = entry.writing
            if request is not None:
                if not block and not request.done():
                    still.append(entry)
                    continue
                entry.writing = None
                try:
                    request.wait()
                except BaseException as exc:  # keep the bytes in memory; report after
                    failed = failed or exc
                    entry.free_after_write = False
                    continue
            if entry.free_after_write and entry.reading is None:
                self._free(entry)
            entry.free_after_write = False
        self._writing = still
        if failed is not None:
            raise failed

    def finish(self) -> None:
        """Wait for every write in flight and free the memory of the tensors written."""
        self._reap(block=True)

    # ------------------------------------------------------------------ whole-store helpers
    def tensors(self) -> list[torch.Tensor]:
        """Every registered tensor, in registration order."""
        return [e.tensor for e in self._entries.values()]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ParamSwapStore is closed")

    def close(self) -> None:
        """Wait for the writes in flight, then remove the swap files. Idempotent.

        The swapped-out tensors keep a zero-byte storage: they are unusable after this.
        """
        if self._closed:
            return
        try:
            self.finish()
        finally:
            self._closed = True
            self.space.close()

    def __repr__(self) -> str:
        swapped = sum(not e.resident for e in self._entries.values())
        return (
            f"ParamSwapStore({str(self.space.path)!r}, tensors={len(self._entries)}, "
            f"swapped={swapped}, max_in_cpu={self.max_in_cpu:,})"
        )
