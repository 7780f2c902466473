"""``await``-able tensor save/load over the swap I/O engine, for asyncio code.

With O_DIRECT (the default) the transfer runs on the engine's worker threads and the coroutine
awaits the request's completion in the event loop's default executor, so the loop is never
blocked. With ``o_direct=False`` a plain buffered file is the goal, and ``aiofiles`` does it
without the engine's block planning. Files are laid out as the engine writes them: the tensor's
bytes from offset 0 (zero-padded to 4096 bytes with O_DIRECT).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import threading

import torch

from slipstream.offload.aio.config import AioSettings
from slipstream.offload.aio.engine import AsyncIOEngine, IORequest
from slipstream.offload.aio.errors import OffloadIOError

__all__ = ["load_tensor", "save_tensor"]

_default: AsyncIOEngine | None = None
_default_lock = threading.Lock()


def default_engine() -> AsyncIOEngine:
    """The engine used when none is given (default settings, created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = AsyncIOEngine(AioSettings())
        return _default


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("save_tensor/load_tensor need a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


async def _await_request(request: IORequest) -> None:
    await asyncio.get_running_loop().run_in_executor(None, request.wait)


async def save_tensor(
    path: str | os.PathLike[str], tensor: torch.Tensor, *, engine: AsyncIOEngine | None = None
) -> None:
    """Write ``tensor``'s bytes to ``path`` (created if missing, not truncated)."""
    engine = engine if engine is not None else default_engine()
    if engine.settings.o_direct:
        await _await_request(engine.write(tensor, path))
        return
    data = _bytes_of(tensor)
    mode = "r+b" if os.path.exists(path) else "wb"
    import aiofiles  # only the buffered path needs it; imported on use

    async with aiofiles.open(path, mode) as file:
        written = await file.write(data)
        await file.flush()
    if written != len(data):  # buffered writers loop internally; never accept less
        raise OffloadIOError(
            errno.EIO, f"short write to {os.fspath(path)}: {written} of {len(data)} bytes", path
        )


async def load_tensor(
    path: str | os.PathLike[str], out: torch.Tensor, *, engine: AsyncIOEngine | None = None
) -> None:
    """Fill ``out`` in place from the bytes at the start of ``path``."""
    engine = engine if engine is not None else default_engine()
    if engine.settings.o_direct:
        await _await_request(engine.read(out, path))
        return
    target = _bytes_of(out)
    try:
        import aiofiles

        async with aiofiles.open(path, "rb") as file:
            data = await file.read(len(target))
    except FileNotFoundError as exc:
        raise OffloadIOError(
            errno.ENOENT, f"cannot load {os.fspath(path)}: the file does not exist", path
        ) from exc
    if len(data) != len(target):
        raise OffloadIOError(
            errno.EIO,
            f"{os.fspath(path)} holds {len(data)} bytes, but the tensor needs {len(target)}",
            path,
        )
    target[:] = data
