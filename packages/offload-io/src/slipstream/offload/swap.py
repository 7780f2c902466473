"""Swap files on NVMe: one file per tensor key, with a checked header, removed on exit.

[Note: swap file layout]
Each key is one file ``<key>.swap`` in the swap folder: a 4096-byte header, then the payload at
offset 4096 (so the payload stays aligned for O_DIRECT). The header holds a magic, the format
version, the dtype name, the element count, the payload size and a CRC-32 of those fields; a
read checks all of them and the file size first, so a file damaged (or replaced) behind the
engine's back raises :class:`SwapFileCorruptError` instead of loading garbage into an optimizer
state. The payload itself is covered by a side record kept in memory (the file is private to this
process, so the record cannot be lost while the file is useful): each ``write`` hashes the tensor
(xxh3_64, slipstream.offload.checksum) before it is submitted, and each ``read`` hashes what
arrived once the transfer has finished; a mismatch (a bit flip, an overwritten or torn payload)
makes that read's ``wait()`` raise :class:`SwapFileCorruptError`.
``aio.verify_checksums = false`` skips both hashes. ``allocate`` reserves the payload with ``posix_fallocate``: a swap folder that cannot
hold the model fails at setup with :class:`DiskFullError`, not half-way through a step.

The folder (``slipstream-<name>-rank<r>-<pid>-<id>``) belongs to one process. It is removed by
``close()``, by garbage collection / interpreter exit (``weakref.finalize``), and on SIGTERM
(torchrun stops workers that way, and Python's default SIGTERM action skips every exit
handler), so crashed or stopped runs do not leave hundreds of GiB behind on the NVMe drive.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import struct
import threading
import uuid
import weakref
import zlib
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from slipstream.offload.aio.config import ALIGNMENT
from slipstream.offload.aio.engine import AsyncIOEngine, IORequest
from slipstream.offload.aio.errors import (
    DirectIOUnsupportedError,
    OffloadIOError,
    SwapFileCorruptError,
    SwapPathError,
    direct_io_error,
    disk_full_error,
)
from slipstream.offload.checksum import tensor_checksum

__all__ = ["HEADER_BYTES", "SwapSpace"]

logger = logging.getLogger(__name__)

HEADER_BYTES = 4096
MAGIC = b"SLPSWAP\x00"
VERSION = 1
# magic, version, dtype name, numel, payload bytes; then the CRC-32 of those packed fields.
_FIELDS = struct.Struct("<8sI32sQQ")
_CRC = struct.Struct("<I")
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}")
_SUFFIX = ".swap"

# Folders of live SwapSpaces, removed by the SIGTERM handler.
_live: set[str] = set()
_live_lock = threading.Lock()
_sigterm_installed = False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


def _remove_folder(path: str) -> None:
    with _live_lock:
        _live.discard(path)
    shutil.rmtree(path, ignore_errors=True)


def _on_sigterm(previous: Any, signum: int, frame: FrameType | None) -> None:
    with _live_lock:
        folders = list(_live)
    for folder in folders:
        _remove_folder(folder)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL (or unknown): die of SIGTERM as the process would have without us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_sigterm_cleanup() -> None:
    """Remove live swap folders on SIGTERM, then run the previous handler (main thread only)."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(previous, signum, frame))
    _sigterm_installed = True


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Entry:
    __slots__ = ("checksum", "dtype", "file", "nbytes", "numel")

    def __init__(self, file: Path, dtype: torch.dtype, numel: int, nbytes: int) -> None:
        self.file = file
        self.dtype = dtype
        self.numel = numel
        self.nbytes = nbytes
        # Of the last payload written (None: never written, or verification is off).
        self.checksum: str | None = None


class SwapSpace:
    """A per-process folder of swap files under ``root`` (see the note at the top).

    Args:
        root: An existing, writable folder, ideally on a local NVMe drive (``nvme_path``).
        engine: The engine doing the I/O; its ``settings.o_direct`` decides whether O_DIRECT is
            probed here.
        name: A label in the folder name (e.g. ``"optimizer"``, ``"params"``).
        rank: The process rank, also in the folder name.

    Raises:
        SwapPathError: ``root`` is missing, not a directory, or not writable.
        DirectIOUnsupportedError: O_DIRECT is on and ``root``'s file system rejects it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        engine: AsyncIOEngine,
        *,
        name: str = "swap",
        rank: int = 0,
    ) -> None:
        self.engine = engine
        root_path = Path(root)
        if not root_path.exists():
            raise SwapPathError(
                errno.ENOENT,
                f"swap folder {root_path} does not exist; create it (mkdir -p) or point "
                "`nvme_path` at an existing folder on an NVMe drive",
                root_path,
            )
        if not root_path.is_dir():
            raise SwapPathError(
                errno.ENOTDIR,
                f"swap path {root_path} is not a directory; point `nvme_path` at a folder",
                root_path,
            )
        folder = f"slipstream-{name}-rank{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = root_path / folder
        try:
            self.path.mkdir(mode=0o700)
        except OSError as exc:
            err = exc.errno or errno.EACCES
            raise SwapPathError(
                err,
                f"swap folder {root_path} is not writable ({os.strerror(err)}: cannot create "
                f"{folder} in it); give this user write access or point `nvme_path` at a "
                "writable folder",
                root_path,
            ) from exc
        self._entries: dict[str, _Entry] = {}
        self._requests: list[IORequest] = []
        self._lock = threading.Lock()
        self._closed = False
        with _live_lock:
            _live.add(str(self.path))
        self._finalizer = weakref.finalize(self, _remove_folder, str(self.path))
        _install_sigterm_cleanup()
        if engine.settings.o_direct:
            try:
                self._probe_direct_io()
            except BaseException:
                self.close()
                raise

    def _probe_direct_io(self) -> None:
        from slipstream.offload.pinned import aligned_empty

        probe = self.path / ".o_direct_probe"
        data = aligned_empty(ALIGNMENT, torch.uint8)
        data.copy_(torch.arange(ALIGNMENT, dtype=torch.int64).remainder(251).to(torch.uint8))
        back = aligned_empty(ALIGNMENT, torch.uint8)
        try:
            self.engine.write(data, probe).wait()
            self.engine.read(back, probe).wait()
        except DirectIOUnsupportedError:
            raise
        except OffloadIOError as exc:
            if exc.errno == errno.EINVAL:
                raise direct_io_error(exc.errno, probe, "by the probe") from exc
            raise
        finally:
            probe.unlink(missing_ok=True)
        if not torch.equal(data, back):
            raise DirectIOUnsupportedError(
                errno.EIO,
                f"the O_DIRECT probe in {self.path} read back different bytes than it wrote; "
                'this file system cannot be trusted with direct I/O: set `"aio": '
                '{"o_direct": false}` or use a local ext4/xfs NVMe mount',
                self.path,
            )

    # -- keys and headers -------------------------------------------------------------------
    def _file(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(
                f"invalid swap key {key!r}: use 1-200 characters from letters, digits, '_', '.' "
                "and '-', not starting with '.' or '-'"
            )
        return self.path / f"{key}{_SUFFIX}"

    @staticmethod
    def _header(dtype: torch.dtype, numel: int, nbytes: int) -> bytes:
        fields = _FIELDS.pack(MAGIC, VERSION, _dtype_name(dtype).encode(), numel, nbytes)
        packed = fields + _CRC.pack(zlib.crc32(fields))
        return packed.ljust(HEADER_BYTES, b"\x00")

    def _payload_reserve(self, nbytes: int) -> int:
        return _round_up(nbytes, ALIGNMENT) if self.engine.settings.o_direct else nbytes

    def _verify(self, key: str, entry: _Entry) -> None:
        file = entry.file
        try:
            with open(file, "rb") as handle:
                raw = handle.read(_FIELDS.size + _CRC.size)
                size = os.fstat(handle.fileno()).st_size
        except FileNotFoundError as exc:
            raise SwapFileCorruptError(
                f"swap file {file} for key {key!r} is missing (deleted behind the engine?)", file
            ) from exc
        if len(raw) < _FIELDS.size + _CRC.size:
            raise SwapFileCorruptError(
                f"swap file {file}: header truncated ({len(raw)} bytes)", file
            )
        magic, version, dtype_raw, numel, nbytes = _FIELDS.unpack_from(raw)
        (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
        problems = []
        if magic != MAGIC:
            problems.append(f"magic {magic!r} != {MAGIC!r}")
        if version != VERSION:
            problems.append(f"format version {version} != {VERSION}")
        if crc != zlib.crc32(raw[: _FIELDS.size]):
            problems.append("header checksum mismatch")
        dtype_name = dtype_raw.rstrip(b"\x00").decode(errors="replace")
        if dtype_name != _dtype_name(entry.dtype):
            problems.append(f"dtype {dtype_name!r} != {_dtype_name(entry.dtype)!r}")
        if numel != entry.numel:
            problems.append(f"numel {numel} != {entry.numel}")
        if nbytes != entry.nbytes:
            problems.append(f"payload bytes {nbytes} != {entry.nbytes}")
        if size < HEADER_BYTES + entry.nbytes:
            problems.append(f"file size {size} < {HEADER_BYTES + entry.nbytes} (header+payload)")
        if problems:
            raise SwapFileCorruptError(
                f"swap file {file} for key {key!r} is corrupt: {'; '.join(problems)}; the swap "
                "folder was modified behind the engine (or the drive is failing): restart "
                "from a checkpoint",
                file,
            )

    # -- public API -------------------------------------------------------------------------
    def allocate(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Create ``key``'s file: write its header and reserve its payload on disk.

        Raises:
            ValueError: A bad key, a key allocated twice, or a negative ``numel``.
            DiskFullError: The file system cannot hold the payload (the partial file is
                removed).
        """
        self._check_open()
        file = self._file(key)
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        with self._lock:
            if key in self._entries:
                raise ValueError(f"swap key {key!r} is already allocated")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        total = HEADER_BYTES + self._payload_reserve(nbytes)
        try:
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            err = exc.errno or errno.EIO
            if err in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(err, file, total, what="creating") from exc
            raise OffloadIOError(
                err, f"cannot create swap file {file}: {os.strerror(err)}", file
            ) from exc
        try:
            header = self._header(dtype, numel, nbytes)
            written = 0
            while written < len(header):
                written += os.pwrite(fd, header[written:], written)
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            os.close(fd)
            file.unlink(missing_ok=True)
            err = exc.errno or errno.EIO
            if err in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(err, file, total, what="reserving") from exc
            raise OffloadIOError(
                err,
                f"cannot reserve {total:,} bytes for swap file {file}: {os.strerror(err)}",
                file,
            ) from exc
        os.close(fd)
        with self._lock:
            self._entries[key] = _Entry(file, dtype, numel, nbytes)

    def _entry(self, key: str, tensor: torch.Tensor, what: str) -> _Entry:
        self._check_open()
        self._file(key)
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"swap key {key!r} is not allocated; call allocate() first")
        if tensor.dtype != entry.dtype or tensor.numel() != entry.numel:
            raise ValueError(
                f"{what} of swap key {key!r}: tensor is {tensor.dtype} × {tensor.numel()}, the "
                f"allocation is {entry.dtype} × {entry.numel}"
            )
        return entry

    def _track(self, request: IORequest) -> IORequest:
        with self._lock:
            self._requests = [r for r in self._requests if not r.done()]
            self._requests.append(request)
        return request

    def write(self, key: str, tensor: torch.Tensor) -> IORequest:
        """Start writing ``tensor`` (matching the allocation) to ``key``'s payload."""
        entry = self._entry(key, tensor, "write")
        # Hashed before submission: the caller must not change the tensor until wait() anyway.
        entry.checksum = tensor_checksum(tensor) if self.engine.settings.verify_checksums else None
        return self._track(self.engine.write(tensor, entry.file, HEADER_BYTES))

    def read(self, key: str, out: torch.Tensor) -> IORequest:
        """Check ``key``'s header, then start filling ``out`` from its payload.

        Raises:
            SwapFileCorruptError: The header or the file size does not match the allocation
                (raised here), or the payload's checksum does not match the last write's
                (raised by the request's ``wait()``).
        """
        entry = self._entry(key, out, "read")
        self._verify(key, entry)
        request = self.engine.read(out, entry.file, HEADER_BYTES)
        expected = entry.checksum
        if expected is not None:
            file = entry.file

            def check() -> None:
                actual = tensor_checksum(out, like=expected)
                if actual != expected:
                    raise SwapFileCorruptError(
                        f"swap file {file} for key {key!r}: the payload read back has checksum "
                        f"{actual}, the last write had {expected}; the file was overwritten "
                        "behind the engine (or the drive is failing): restart from a checkpoint",
                        file,
                    )

            request.add_check(check)
        return self._track(request)

    def keys(self) -> list[str]:
        """The allocated keys."""
        with self._lock:
            return list(self._entries)

    def nbytes(self) -> int:
        """Bytes allocated on disk (headers and O_DIRECT padding included)."""
        with self._lock:
            entries = list(self._entries.values())
        return sum(HEADER_BYTES + self._payload_reserve(e.nbytes) for e in entries)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the SwapSpace at {self.path} is closed")

    def close(self) -> None:
        """Wait for this space's I/O, then remove its files and folder. Idempotent.

        A request that failed and was never waited for is logged here (its ``wait()`` still
        raises), so closing in a ``finally`` block does not mask the original exception.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            requests, self._requests = self._requests, []
        for request in requests:
            try:
                request.wait()
            except OffloadIOError as exc:
                logger.warning("swap I/O failed before close(): %s", exc)
        self._finalizer()

    def __enter__(self) -> SwapSpace:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapSpace({str(self.path)!r}, keys={len(self._entries)})"
