"""Asynchronous direct I/O between host tensors and NVMe swap files.

:class:`AsyncIOEngine` reads and writes CPU tensors to files with O_DIRECT in parallel blocks
(``cpp`` or ``python`` backend), configured by :class:`AioSettings` (DeepSpeed's ``"aio"``
block); failures raise the :class:`OffloadIOError` subclasses in :mod:`.errors`.
"""

from slipstream.offload.aio.asyncio_api import load_tensor, save_tensor
from slipstream.offload.aio.config import ALIGNMENT, AioSettings
from slipstream.offload.aio.engine import AsyncIOEngine, IORequest
from slipstream.offload.aio.errors import (
    DirectIOUnsupportedError,
    DiskFullError,
    OffloadIOError,
    SwapFileCorruptError,
    SwapPathError,
)

__all__ = [
    "ALIGNMENT",
    "AioSettings",
    "AsyncIOEngine",
    "DirectIOUnsupportedError",
    "DiskFullError",
    "IORequest",
    "OffloadIOError",
    "SwapFileCorruptError",
    "SwapPathError",
    "load_tensor",
    "save_tensor",
]
