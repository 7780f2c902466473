"""Errors of the NVMe swap I/O layer, each saying what went wrong *and what to do*.

Every failure of a read or write surfaces as an :class:`OffloadIOError` (an ``OSError``, so
existing ``except OSError`` handlers still catch it, with ``errno`` and ``filename`` set). The
subclasses cover the failures a user can act on: a bad swap folder, a full disk, a file system
without O_DIRECT, and a damaged swap file. A swap tier fails far from the code that configured it
(deep in an optimizer step), so the messages name the path and the setting to change instead of
leaving the user with a bare ``[Errno 28]``.
"""

from __future__ import annotations

import errno as errno_module
import os
import shutil
from pathlib import Path

__all__ = [
    "DirectIOUnsupportedError",
    "DiskFullError",
    "OffloadIOError",
    "SwapFileCorruptError",
    "SwapPathError",
    "error_from_errno",
    "filesystem_type",
]


class OffloadIOError(OSError):
    """A swap read or write failed; the message names the path, offset, size and reason."""

    def __init__(self, err: int, message: str, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(err, message, None if path is None else os.fspath(path))
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # keep the message through pickling (multiprocessing, executors)
        return (type(self), (self.errno, self.message, self.filename))


class SwapPathError(OffloadIOError):
    """The swap folder is missing, not a directory, or not writable."""


class DiskFullError(OffloadIOError):
    """The swap file system has no room (ENOSPC or EDQUOT)."""


class DirectIOUnsupportedError(OffloadIOError):
    """The file system rejected O_DIRECT (EINVAL at open or on the first I/O)."""


class SwapFileCorruptError(OffloadIOError):
    """A swap file's header does not match what was written (magic, version, checksum, size)."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(errno_module.EIO, message, path)

    def __reduce__(self):
        return (type(self), (self.message, self.filename))


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """The type of the file system holding ``path`` (from ``/proc/mounts``), if readable."""
    try:
        target = os.path.realpath(path)
        with open("/proc/mounts", encoding="utf-8", errors="replace") as mounts:
            entries = [line.split() for line in mounts]
    except OSError:
        return None
    best, best_type = "", None
    for fields in entries:
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fields[2]
    return best_type


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def disk_full_error(
    err: int, path: str | os.PathLike[str], needed: int, *, what: str = "writing"
) -> DiskFullError:
    """A :class:`DiskFullError` naming the path, the bytes needed and the bytes free."""
    free = _free_bytes(Path(path))
    free_text = "unknown" if free is None else f"{free:,}"
    reason = "disk quota exceeded" if err == errno_module.EDQUOT else "no space left on device"
    return DiskFullError(
        err,
        f"{reason} while {what} {os.fspath(path)}: needed {needed:,} bytes, {free_text} bytes "
        "free on that file system; free space there or point `nvme_path` at a larger NVMe "
        "volume",
        path,
    )


def direct_io_error(err: int, path: str | os.PathLike[str], when: str) -> DirectIOUnsupportedError:
    """A :class:`DirectIOUnsupportedError` naming the path and its file system type."""
    fs_type = filesystem_type(Path(path).parent if not os.path.isdir(path) else path)
    fs_text = f"file system type {fs_type!r}" if fs_type else "file system of unknown type"
    return DirectIOUnsupportedError(
        err,
        f"O_DIRECT is not supported for {os.fspath(path)} ({fs_text}; rejected {when}); put the "
        'swap folder on a real NVMe mount (ext4, xfs), or set `"aio": {"o_direct": false}` to '
        "use buffered I/O (slower, goes through the page cache)",
        path,
    )


def error_from_errno(
    err: int,
    path: str | os.PathLike[str],
    *,
    op: str,
    offset: int,
    size: int,
    direct: bool,
    detail: str = "",
) -> OffloadIOError:
    """Map the errno of a failed ``op`` ("read" or "write") to the matching error class.

    ENOSPC/EDQUOT become :class:`DiskFullError`; EINVAL with O_DIRECT (every buffer, size and
    offset the engine issues is 4096-aligned, so EINVAL means the file system refused direct
    I/O) becomes :class:`DirectIOUnsupportedError`; anything else a generic
    :class:`OffloadIOError` with the path, offset, size and ``strerror``.
    """
    if err in (errno_module.ENOSPC, errno_module.EDQUOT):
        return disk_full_error(err, path, size, what=f"{op} at offset {offset} of")
    if err == errno_module.EINVAL and direct:
        return direct_io_error(err, path, f"on the first {op}")
    extra = f" ({detail})" if detail else ""
    return OffloadIOError(
        err,
        f"{op} of {size:,} bytes at offset {offset:,} of {os.fspath(path)} failed: "
        f"{os.strerror(err)} [errno {err}]{extra}",
        path,
    )
