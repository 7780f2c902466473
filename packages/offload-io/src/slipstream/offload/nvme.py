"""NvmeStateSwapper: fp32 masters and optimizer states on NVMe between their sub-group's steps.

ZeRO-Infinity's optimizer tier. Each swapped tensor (a master shard, its ``exp_avg``, ...)
keeps its identity for the whole run (the optimizer, its ``param_groups`` and the checkpoint
code all refer to it); swapping it out writes its bytes to a swap file and resizes its
*storage* to zero bytes, swapping it in resizes the storage back and reads the bytes in. So
host memory holds only the sub-groups in flight: the one stepping, the next one being read
(``pipeline_read``) and the previous ones being written (``pipeline_write``), at most
``buffer_count`` of them: when the drive writes slower than the CPU steps, the step waits for
the oldest write rather than keeping every sub-group in memory until the step ends.

Scalars (``step``) and anything smaller than a page stay in memory; so do the gradients (the
reduce-scatter writes into them during backward).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from slipstream.offload.settings import OptimizerOffload

if TYPE_CHECKING:
    from slipstream.offload.aio.engine import IORequest
    from slipstream.offload.swap import SwapSpace

__all__ = ["NvmeStateSwapper"]

logger = logging.getLogger(__name__)

_MIN_SWAP_NUMEL = 1024  # smaller tensors are not worth a file (and a request) of their own


@dataclass(slots=True)
class _Slot:
    """One swapped tensor: its file key and whether its bytes are in memory now."""

    key: str
    tensor: torch.Tensor
    resident: bool = True
    reading: IORequest | None = None
    writing: list[IORequest] = field(default_factory=list)


class NvmeStateSwapper:
    """Moves HostOptimizer sub-groups between NVMe swap files and host memory.

    Args:
        optimizer: the torch optimizer whose parameters (host fp32 masters) and per-parameter
            state tensors are swapped.
        space: the swap folder (slipstream.offload.swap.SwapSpace) on the NVMe drive.
        settings: ``pipeline_read``/``pipeline_write`` switch the overlap on.
        names: a stable name for each parameter (file keys), by ``id``; default: its position.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        space: SwapSpace,
        settings: OptimizerOffload,
        names: dict[int, str] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.space = space
        self.settings = settings
        self._slots: dict[int, _Slot] = {}  # by id(tensor)
        self._index = {
            id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
        }
        self._names = names or {}
        # Sub-groups (their slots) whose writes are in flight, oldest first; at most
        # ``max_writing`` of them stay in memory (see the note at the top).
        self._writing: list[list[_Slot]] = []
        read_ahead = 1 if settings.pipeline_read else 0
        self.max_writing = (
            max(0, settings.buffer_count - 1 - read_ahead) if settings.pipeline_write else 0
        )
        # Files already created (a tensor replaced by load_state_dict reuses its file).
        self._allocated: set[str] = set()

    # ------------------------------------------------------------------ bookkeeping
    def _key(self, param: torch.Tensor, what: str) -> str:
        base = self._names.get(id(param)) or f"p{self._index[id(param)]}"
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)
        return f"{safe}.{what}"

    def _tensors(self, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        found = [("master", param)]
        for key, value in self.optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.numel() == param.numel():
                found.append((key, value))
        return [(k, t) for k, t in found if t.numel() >= _MIN_SWAP_NUMEL]

    def _slot(self, param: torch.Tensor, what: str, tensor: torch.Tensor) -> _Slot:
        slot = self._slots.get(id(tensor))
        if slot is None or slot.tensor is not tensor:
            slot = _Slot(self._key(param, what), tensor)
            self._slots[id(tensor)] = slot
        return slot

    @property
    def resident_bytes(self) -> int:
        """Host bytes the swapped tensors hold now (in memory or in flight)."""
        return sum(
            s.tensor.numel() * s.tensor.element_size() for s in self._slots.values() if s.resident
        )

    # ------------------------------------------------------------------ swapping
    def _begin_read(self, slot: _Slot) -> None:
        if slot.resident:
            return
        tensor = slot.tensor
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        slot.reading = self.space.read(slot.key, tensor)
        slot.resident = True

    def _finish_read(self, slot: _Slot) -> None:
        if slot.reading is not None:
            slot.reading.wait()
            slot.reading = None

    def _wait_writes(self, slot: _Slot) -> None:
        for request in slot.writing:
            request.wait()
        slot.writing.clear()

    def prefetch(self, params: Sequence[torch.Tensor]) -> None:
        """Start reading ``params``' tensors (``pipeline_read``; otherwise a no-op)."""
        if not self.settings.pipeline_read:
            return
        for param in params:
            for what, tensor in self._tensors(param):
                slot = self._slot(param, what, tensor)
                self._wait_writes(slot)
                self._begin_read(slot)

    def swap_in(self, params: Sequence[torch.Tensor]) -> None:
        """Make ``params``' masters and states resident (waiting for reads in flight)."""
        slots = []
        for param in params:
            for what, tensor in self._tensors(param):
                slot = self._slot(param, what, tensor)
                self._wait_writes(slot)
                self._begin_read(slot)
                slots.append(slot)
        for slot in slots:
            self._finish_read(slot)

    def swap_out(self, params: Sequence[torch.Tensor]) -> None:
        """Write ``params``' tensors back and release their memory once written.

        With ``pipeline_write`` the writes overlap the next sub-groups' steps, up to
        ``max_writing`` sub-groups at a time (this call waits for the oldest beyond that);
        without it, this call waits for them.
        """
        group: list[_Slot] = []
        for param in params:
            for what, tensor in self._tensors(param):
                slot = self._slot(param, what, tensor)
                if not slot.resident:
                    continue
                self._finish_read(slot)
                if slot.key not in self._allocated:
                    self.space.allocate(slot.key, tensor.numel(), tensor.dtype)
                    self._allocated.add(slot.key)
                slot.writing.append(self.space.write(slot.key, tensor))
                group.append(slot)
        if group:
            self._writing.append(group)
        # Free what has been written already, then wait for the oldest beyond the bound.
        while self._writing and all(r.done() for s in self._writing[0] for r in s.writing):
            self._release(self._writing.pop(0))
        while len(self._writing) > self.max_writing:
            self._release(self._writing.pop(0))

    def _release(self, group: list[_Slot]) -> None:
        """Wait for ``group``'s writes, then free the memory of its tensors."""
        for slot in group:
            self._wait_writes(slot)
            if slot.resident and slot.reading is None:
                slot.tensor.untyped_storage().resize_(0)
                slot.resident = False

    def finish(self) -> None:
        """Wait for every write in flight and free the written tensors' memory."""
        while self._writing:
            self._release(self._writing.pop(0))

    def check_room(self, states_per_param: int, ranks_sharing: int = 1) -> int:
        """Fail now, not at the first step, if the swap drive cannot hold what will be swapped.

        The optimizer states are created lazily at the first step, so without this a drive
        that is too small would fail there, after the model was built and data loaded.
        ``states_per_param``: state tensors of each parameter's size (Adam 2, Lion 1, ...);
        ``ranks_sharing``: processes of this node swapping to the same drive.

        Returns the bytes this rank needs (masters and states; headers not counted).
        Raises:
            DiskFullError: naming the path, the bytes needed for the node and the bytes free.
        """
        from slipstream.offload.aio.errors import DiskFullError

        numel = sum(p.numel() for p in self.all_params() if p.numel() >= _MIN_SWAP_NUMEL)
        needed = numel * 4 * (1 + states_per_param)
        node = needed * max(1, ranks_sharing)
        free = shutil.disk_usage(self.space.path).free
        if node > free:
            raise DiskFullError(
                errno.ENOSPC,
                f"NVMe optimizer offload needs about {node:,} bytes in {os.fspath(self.space.path)} "
                f"(fp32 masters and {states_per_param} state(s) per parameter, {needed:,} bytes "
                f"per rank x {max(1, ranks_sharing)} rank(s) on this node) but that file system "
                f"has {free:,} bytes free; free space there, point `nvme_path` at a larger NVMe "
                'volume, or use `"device": "cpu"` if host memory allows',
                self.space.path,
            )
        return needed

    def all_params(self) -> list[torch.Tensor]:
        """Every parameter of the optimizer, in order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def evict_all(self) -> None:
        """Swap every parameter's tensors out (after set-up and after a checkpoint load)."""
        params = self.all_params()
        for start in range(0, len(params), 64):
            self.swap_out(params[start : start + 64])
        self.finish()

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Everything in host memory for the block (checkpoint save/load), swapped out after.

        Needs host memory for this rank's whole optimizer shard while the block runs.
        """
        params = self.all_params()
        self.swap_in(params)
        try:
            yield
        finally:
            self.evict_all()
