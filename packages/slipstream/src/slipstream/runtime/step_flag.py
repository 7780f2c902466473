"""FlagCopy: a step's device-side skip flag on its way to the host, read only when needed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FlagCopy"]


@dataclass(frozen=True, slots=True)
class FlagCopy:
    """A device flag on its way to the host: copied into page-locked memory behind the step's
    kernels, with an event after the copy. Reading it waits for that event only, not for the
    work queued since (``.item()`` on the device tensor would wait for the whole stream).

    Both engines keep the flag of a step whose skip was decided on the device
    ([Note: the skip decided on the device] in slipstream.zero) and read it later, where a
    host decision needs it (the LR schedule, the fp16 scale, the counters).
    """

    device_flag: torch.Tensor
    host: torch.Tensor | None
    event: Any

    @classmethod
    def start(cls, flag: torch.Tensor | None) -> FlagCopy | None:
        """Start copying ``flag`` (None: nothing to copy)."""
        if flag is None:
            return None
        if flag.device.type != "cuda":
            return cls(flag, None, None)  # CPU: the value is there when the step returns
        host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(flag, host, event)

    def ready(self) -> bool:
        """Whether :meth:`read` would return without waiting (the copy has landed)."""
        return self.host is None or bool(self.event.query())

    def read(self) -> bool:
        """Whether the flag is set (waits for the copy, at most)."""
        if self.host is None:
            return bool(self.device_flag.item())
        self.event.synchronize()
        return bool(self.host.item())  # a host tensor: no device sync
