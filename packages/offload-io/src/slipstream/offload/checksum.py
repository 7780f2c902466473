"""Fast content checksums of tensors and files, for swap payloads and checkpoint files.

A checksum is a string ``"<algorithm>:<hex digest>"``, so a record says how it was made and a
reader on another machine checks it the same way:

- ``xxh3_64`` (the `xxhash` package, a dependency of slipstream-offload-io): about 26 GB/s on
  one core of the development machine, fast enough to check every swap read;
- ``crc32`` (``zlib.crc32``, the standard library): about 3-4 GB/s there; used to *write*
  checksums only where `xxhash` is not installed, and always readable.

Both release the GIL on large buffers. Neither is cryptographic: they detect damage (bit flips,
torn or overwritten writes, truncation), not tampering.
"""

from __future__ import annotations

import ctypes
import os
import zlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "ALGORITHM",
    "ChecksumUnavailableError",
    "Hasher",
    "file_checksum",
    "new_hasher",
    "tensor_bytes",
    "tensor_checksum",
]

_xxhash: Any
try:  # pragma: no cover - which branch runs depends on the environment
    import xxhash as _xxhash  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover
    _xxhash = None

ALGORITHM = "xxh3_64" if _xxhash is not None else "crc32"
"""The algorithm new checksums use: ``xxh3_64`` where `xxhash` is installed, else ``crc32``."""

_CHUNK = 16 << 20  # file reads for hashing


class ChecksumUnavailableError(RuntimeError):
    """A recorded checksum uses an algorithm this installation cannot compute."""


class Hasher:
    """Incremental checksum of one algorithm: ``update`` with buffers, then ``hexdigest``."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._crc = 0
        self._xxh: Any = None
        if algorithm == "xxh3_64":
            if _xxhash is None:
                raise ChecksumUnavailableError(
                    "this checksum was written with xxh3_64 but the `xxhash` package is not "
                    "installed here; `pip install xxhash` (or turn verification off, see "
                    "docs/reliability.md)"
                )
            self._xxh = _xxhash.xxh3_64()
        elif algorithm != "crc32":
            raise ChecksumUnavailableError(
                f"unknown checksum algorithm {algorithm!r}; this version knows xxh3_64 and crc32"
            )

    def update(self, data: Any) -> None:
        """Add a bytes-like buffer."""
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        """The checksum string ``"<algorithm>:<hex>"``."""
        if self._xxh is not None:
            return f"{self.algorithm}:{self._xxh.hexdigest()}"
        return f"{self.algorithm}:{self._crc:08x}"


def new_hasher(like: str | None = None) -> Hasher:
    """A hasher of ``like``'s algorithm (a recorded checksum string), or of :data:`ALGORITHM`."""
    return Hasher(like.partition(":")[0] if like else ALGORITHM)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor of any dtype (valid while it lives).

    Made through ctypes, not ``Tensor.numpy()``: NumPy's export marks the storage
    non-resizable, and the NVMe swapper frees swapped tensors by resizing their storage.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def tensor_checksum(tensor: torch.Tensor, like: str | None = None) -> str:
    """Checksum of a contiguous CPU tensor's bytes (``like``: use that record's algorithm)."""
    hasher = new_hasher(like)
    if tensor.numel():
        hasher.update(tensor_bytes(tensor))
    return hasher.hexdigest()


def file_checksum(
    path: str | os.PathLike[str],
    like: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> str:
    """Checksum of a whole file, read in 16 MiB chunks (``progress(bytes)`` after each)."""
    hasher = new_hasher(like)
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(view)
            if not count:
                break
            hasher.update(view[:count])
            if progress is not None:
                progress(count)
    return hasher.hexdigest()
