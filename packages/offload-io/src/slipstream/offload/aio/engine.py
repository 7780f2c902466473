"""The asynchronous I/O engine: tensors to and from swap files, O_DIRECT, in parallel.

[Note: how a transfer is cut up]
``write``/``read`` plan a transfer in Python (:func:`plan_ops`) and hand the ops to a backend
that only executes them, so both backends put the same bytes at the same places:

- Without O_DIRECT: ``block_size`` pieces straight from/to the tensor (buffered pread/pwrite).
- With O_DIRECT and a 4096-aligned tensor: the aligned body goes straight from/to the tensor's
  memory in ``block_size`` pieces (no copy); the last ``nbytes % 4096`` bytes go through a
  4096-byte bounce buffer, written zero-padded (the file's payload is padded to a multiple of
  4096) and, on read, with the padding discarded.
- With O_DIRECT and an unaligned tensor: every piece is staged through the worker thread's
  aligned bounce buffer (``block_size`` bytes), one block at a time.

Up to ``intra_op_parallelism × queue_depth`` pieces are in flight at once:

- ``cpp`` backend with O_DIRECT: Linux kernel AIO (``csrc/aio.cpp``, raw ``io_submit``
  syscalls): ``intra_op_parallelism`` threads, each keeping ``queue_depth`` pieces in flight,
  honouring ``single_submit`` and ``overlap_events``. Falls back to its thread pool (logged)
  when ``io_setup`` fails; ``AioSettings.kernel_aio=False`` (``aio.kernel_aio``) forces the
  pool.
- ``cpp`` without O_DIRECT, and ``python``: ``intra_op_parallelism × queue_depth`` worker
  threads each blocked in one pread/pwrite (buffered I/O through kernel AIO would run
  synchronously inside ``io_submit``). The ``python`` backend is a ``ThreadPoolExecutor`` doing
  ``os.preadv``/``os.pwritev``, which release the GIL inside the syscall.

``auto`` takes ``cpp`` (built into the :mod:`slipstream.kernels.build_ops` cache on first use)
and falls back to ``python`` with one warning when the extension cannot be built or loaded.
:attr:`AsyncIOEngine.io_mode` says which of ``"kernel-aio"``/``"threads"`` is in use.

The file is opened when the request is made (so a missing file or a file system without
O_DIRECT raises from ``read``/``write`` right away) and closed by the backend when the last
piece has finished. I/O errors are reported by :meth:`IORequest.wait`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

import torch

from slipstream.offload.aio.config import ALIGNMENT, AioSettings
from slipstream.offload.aio.errors import (
    OffloadIOError,
    direct_io_error,
    disk_full_error,
    error_from_errno,
)

__all__ = ["AsyncIOEngine", "IORequest", "plan_ops"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpp", "python")
UNEXPECTED_EOF = -1  # backend result code: the file ended before the bytes a read needs
SHORT_ONCE = -1  # Op.inject value: the first syscall of the op transfers only half
_fallback_warned = False
_fallback_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Op:
    """One piece of a transfer: file bytes ``[offset, offset + io_len)`` from/to ``ptr``.

    ``staged`` pieces go through the worker's aligned bounce buffer, of which ``need`` bytes
    belong to the tensor (the rest is zero padding on write, discarded on read). ``inject`` is
    the test seam (see :meth:`AsyncIOEngine._inject_error`).
    """

    ptr: int
    io_len: int
    need: int
    offset: int
    staged: bool
    inject: int = 0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_ops(ptr: int, nbytes: int, offset: int, *, direct: bool, block_size: int) -> list[Op]:
    """Cut a transfer of ``nbytes`` at address ``ptr`` into ops (see the note at the top)."""
    ops: list[Op] = []
    if not direct:
        for start in range(0, nbytes, block_size):
            size = min(block_size, nbytes - start)
            ops.append(Op(ptr + start, size, size, offset + start, False))
        return ops
    if ptr % ALIGNMENT == 0:
        body = nbytes - nbytes % ALIGNMENT
        for start in range(0, body, block_size):
            size = min(block_size, body - start)
            ops.append(Op(ptr + start, size, size, offset + start, False))
        if body < nbytes:
            ops.append(Op(ptr + body, ALIGNMENT, nbytes - body, offset + body, True))
        return ops
    for start in range(0, nbytes, block_size):
        size = min(block_size, nbytes - start)
        ops.append(Op(ptr + start, _round_up(size, ALIGNMENT), size, offset + start, True))
    return ops


class _Batch(Protocol):
    def wait(self) -> tuple[int, int, int, int]: ...

    def done(self) -> bool: ...


class _Backend(Protocol):
    name: str
    mode: str

    def submit(self, fd: int, write: bool, direct: bool, ops: Sequence[Op]) -> _Batch: ...

    def close(self) -> None: ...


class _CppBackend:
    """Executes ops in ``csrc/aio.cpp``: kernel AIO for O_DIRECT, else its thread pool."""

    name = "cpp"

    def __init__(self, settings: AioSettings, bounce_bytes: int) -> None:
        from slipstream.offload.build import load_aio

        self._module = load_aio()
        kernel_aio = settings.o_direct and settings.kernel_aio
        self._engine = self._module.Engine(
            settings.intra_op_parallelism,
            settings.queue_depth,
            bounce_bytes,
            kernel_aio,
            settings.single_submit,
            settings.overlap_events,
        )
        self.mode: str = self._engine.mode
        if kernel_aio and self.mode != "kernel-aio":
            logger.info(
                "kernel AIO is unavailable (%s); the cpp aio backend uses its pread/pwrite "
                "thread pool instead",
                self._engine.mode_reason,
            )

    def submit(self, fd: int, write: bool, direct: bool, ops: Sequence[Op]) -> _Batch:
        batch: _Batch = self._engine.submit(
            fd,
            write,
            direct,
            True,
            [op.ptr for op in ops],
            [op.io_len for op in ops],
            [op.need for op in ops],
            [op.offset for op in ops],
            [op.staged for op in ops],
            [op.inject for op in ops],
        )
        return batch

    def close(self) -> None:
        self._engine.stop()


class _PyBatch:
    """The ops of one request on the python backend; closes the file after the last op."""

    def __init__(self, fd: int, count: int) -> None:
        self._fd = fd
        self._remaining = count
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._result = (0, 0, 0, 0)

    def finish(self, err: int, offset: int, length: int, done: int) -> None:
        with self._lock:
            if err and not self._result[0]:
                self._result = (err, offset, length, done)
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            os.close(self._fd)
            self._event.set()

    def wait(self) -> tuple[int, int, int, int]:
        self._event.wait()
        return self._result

    def done(self) -> bool:
        return self._event.is_set()


def _memory(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory (a tensor's storage, kept alive by the request)."""
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


class _PythonBackend:
    """Executes ops on a ``ThreadPoolExecutor`` with ``os.preadv``/``os.pwritev``."""

    name = "python"
    mode = "threads"

    def __init__(self, threads: int, bounce_bytes: int) -> None:
        self._bounce_bytes = bounce_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="slipstream-aio")
        self._local = threading.local()

    def _bounce(self) -> tuple[int, memoryview]:
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            from slipstream.offload.pinned import aligned_empty

            tensor = aligned_empty(self._bounce_bytes, torch.uint8)
            bounce = (tensor, tensor.data_ptr(), _memory(tensor.data_ptr(), self._bounce_bytes))
            self._local.bounce = bounce
        return bounce[1], bounce[2]

    def submit(self, fd: int, write: bool, direct: bool, ops: Sequence[Op]) -> _Batch:
        batch = _PyBatch(fd, len(ops))
        for op in ops:
            self._pool.submit(self._run, batch, fd, write, direct, op)
        return batch

    def _run(self, batch: _PyBatch, fd: int, write: bool, direct: bool, op: Op) -> None:
        done = 0
        try:
            err, done = self._run_op(fd, write, direct, op)
        except OSError as exc:  # pragma: no cover - defensive: report instead of losing it
            err = exc.errno or errno.EIO
        except BaseException:  # pragma: no cover - a bug must still complete the batch
            logger.exception("unexpected error in a python aio worker")
            err = errno.EIO
        batch.finish(err, op.offset, op.io_len, done)

    def _run_op(self, fd: int, write: bool, direct: bool, op: Op) -> tuple[int, int]:
        if op.inject > 0:
            return op.inject, 0
        if op.staged:
            bounce_ptr, bounce = self._bounce()
            view = bounce[: op.io_len]
            if write:
                ctypes.memmove(bounce_ptr, op.ptr, op.need)
                ctypes.memset(bounce_ptr + op.need, 0, op.io_len - op.need)
        else:
            view = _memory(op.ptr, op.io_len)
        done = 0
        shorten = op.inject == SHORT_ONCE
        while done < op.io_len:
            length = op.io_len - done
            if shorten:
                half = (length // 2) // ALIGNMENT * ALIGNMENT if direct else length // 2
                length = half or length
                shorten = False
            piece = view[done : done + length]
            try:  # EINTR is retried by Python itself (PEP 475)
                if write:
                    got = os.pwritev(fd, [piece], op.offset + done)
                else:
                    got = os.preadv(fd, [piece], op.offset + done)
            except OSError as exc:
                return exc.errno or errno.EIO, done
            if got == 0:
                if write:
                    return errno.EIO, done  # no progress: would loop forever
                if done >= op.need:
                    break  # only the padded tail is missing
                return UNEXPECTED_EOF, done
            done += got
            # A short read may have hit the end of the file: fine once the tensor's bytes are
            # in (the rest is padding, absent from files written without O_DIRECT). With
            # O_DIRECT, one ending at an unaligned position can only be the end of the file (a
            # retry from there would fail with EINVAL). Otherwise keep reading: at the end of
            # the file the next read returns 0.
            unaligned = direct and done % ALIGNMENT != 0
            if not write and got < length and (done >= op.need or unaligned):
                if done >= op.need:
                    break
                return UNEXPECTED_EOF, done
        if op.staged and not write:
            ctypes.memmove(op.ptr, bounce_ptr, op.need)
        return 0, done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _warn_fallback(reason: str) -> None:
    global _fallback_warned
    with _fallback_lock:
        if _fallback_warned:
            return
        _fallback_warned = True
    logger.warning(
        "the C++ aio extension is unavailable (%s); swap I/O uses the slower python backend. "
        "Fix: install a C++ compiler and run `python -m slipstream.offload.build`",
        reason,
    )


def _make_backend(name: str, settings: AioSettings, bounce_bytes: int) -> _Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown aio backend {name!r}; choose one of {', '.join(BACKENDS)}")
    threads = settings.intra_op_parallelism * settings.queue_depth
    if name == "python":
        return _PythonBackend(threads, bounce_bytes)
    try:
        return _CppBackend(settings, bounce_bytes)
    except Exception as exc:
        if name == "cpp":
            raise ImportError(
                f"the cpp aio backend is unavailable: {type(exc).__name__}: {exc}; run "
                "`python -m slipstream.offload.build` to see why, or use backend='python'"
            ) from exc
        _warn_fallback(f"{type(exc).__name__}: {exc}")
        return _PythonBackend(threads, bounce_bytes)


class IORequest:
    """One asynchronous read or write; :meth:`wait` for it, then the tensor may be reused.

    The request keeps the tensor (and its storage) alive until the I/O is finished.
    """

    def __init__(
        self,
        batch: _Batch | None,
        *,
        op: str,
        path: Path,
        offset: int,
        nbytes: int,
        direct: bool,
        tensor: torch.Tensor,
    ) -> None:
        self._batch = batch
        self._op = op
        self._path = path
        self._offset = offset
        self._nbytes = nbytes
        self._direct = direct
        self._tensor: torch.Tensor | None = tensor
        self._error: OffloadIOError | None = None
        self._finished = batch is None
        self._reported = False  # the error was raised to a caller (by wait or wait_all)
        self._lock = threading.Lock()
        # Run once when the transfer has succeeded (SwapSpace's payload checksum); what it
        # raises becomes this request's error.
        self._check: Callable[[], None] | None = None

    @property
    def path(self) -> Path:
        """The file this request reads or writes."""
        return self._path

    @property
    def nbytes(self) -> int:
        """Payload bytes transferred (without O_DIRECT padding)."""
        return self._nbytes

    def add_check(self, check: Callable[[], None]) -> None:
        """Run ``check`` once the transfer has succeeded; an OffloadIOError it raises is the
        request's error (raised by :meth:`wait`). Used to verify a payload's checksum."""
        with self._lock:
            if self._finished:
                if self._error is None:
                    try:
                        check()
                    except OffloadIOError as error:
                        self._error = error
                return
            self._check = check

    def done(self) -> bool:
        """Whether the I/O has finished (successfully or not); never blocks."""
        batch = self._batch
        return self._finished or (batch is not None and batch.done())

    def wait(self) -> None:
        """Block until the I/O has finished.

        Raises:
            OffloadIOError: The read or write failed (the matching subclass, e.g.
                :class:`~slipstream.offload.aio.errors.DiskFullError`); raised again by every
                later ``wait``. A failed request never leaves a silently short transfer.
        """
        error = self._collect()
        if error is not None:
            self._reported = True
            raise error

    def _collect(self) -> OffloadIOError | None:
        """Block until finished; the error (if any), without marking it as reported."""
        with self._lock:
            if not self._finished:
                assert self._batch is not None
                result = self._batch.wait()
                self._error = self._make_error(*result) if result[0] else None
                check, self._check = self._check, None
                if self._error is None and check is not None:
                    try:
                        check()
                    except OffloadIOError as error:
                        self._error = error
                self._finished = True
                self._tensor = None  # release the tensor (and the batch) once finished
                self._batch = None
            return self._error

    def _settle(self) -> bool:
        """Collect a finished request's outcome; whether it failed and nobody was told yet."""
        return self._collect() is not None and not self._reported

    def _make_error(self, err: int, offset: int, length: int, done: int) -> OffloadIOError:
        if err == UNEXPECTED_EOF:
            try:
                size: int | str = self._path.stat().st_size
            except OSError:
                size = "unknown"
            return OffloadIOError(
                errno.EIO,
                f"read of {length:,} bytes at offset {offset:,} of {self._path} hit the end of "
                f"the file after {done:,} bytes (file size {size}); the file is shorter than "
                "the tensor: was it written completely?",
                self._path,
            )
        if err in (errno.ENOSPC, errno.EDQUOT):
            return disk_full_error(err, self._path, self._nbytes, what=f"{self._op} of")
        return error_from_errno(
            err,
            self._path,
            op=self._op,
            offset=offset,
            size=length,
            direct=self._direct,
            detail=f"{done:,} bytes transferred before the error" if done else "",
        )

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"IORequest({self._op} {self._nbytes} bytes {self._path} @ {self._offset}, {state})"


class AsyncIOEngine:
    """Asynchronous tensor reads and writes to files, for NVMe swap (see the module note).

    Args:
        settings: The ``"aio"`` settings (defaults: 1 MiB blocks, 8 in flight, O_DIRECT).
        backend: ``"auto"`` (C++ if it can be built or loaded, else python with one warning),
            ``"cpp"`` (ImportError if unavailable) or ``"python"``.
    """

    def __init__(self, settings: AioSettings | None = None, backend: str = "auto") -> None:
        self.settings = settings if settings is not None else AioSettings()
        bounce = _round_up(self.settings.block_size, ALIGNMENT)
        self._backend = _make_backend(backend, self.settings, bounce)
        self.backend_name: str = self._backend.name
        # "kernel-aio" (cpp with O_DIRECT) or "threads" (pread/pwrite workers).
        self.io_mode: str = self._backend.mode
        self._pending: list[IORequest] = []
        self._lock = threading.Lock()
        self._inject: dict[str, list[int]] = {"read": [], "write": []}
        self._closed = False

    # -- the test seam ------------------------------------------------------------------------
    def _inject_error(self, err: int, op: str = "write", *, count: int = 1) -> None:
        """TEST ONLY: make the next ``count`` ``op`` ("read"/"write") requests fail with ``err``.

        The first piece of each such request fails inside the backend's worker as if the syscall
        had returned ``err`` (both backends), so the error travels the real reporting path to
        :meth:`IORequest.wait`. ``err=SHORT_ONCE`` (-1) instead makes that piece's first
        syscall transfer only half its bytes, exercising the short-transfer retry.
        """
        if op not in self._inject:
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        with self._lock:
            self._inject[op].extend([err] * count)

    # -- requests ---------------------------------------------------------------------------
    def write(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0
    ) -> IORequest:
        """Start writing ``tensor``'s bytes to ``path`` at byte ``offset``; returns at once.

        The file is created if missing and never truncated. With O_DIRECT the payload on disk
        is zero-padded to a multiple of 4096 bytes and ``offset`` must be a multiple of 4096.
        """
        return self._submit("write", tensor, path, offset)

    def read(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0
    ) -> IORequest:
        """Start filling ``tensor`` in place from ``path`` at byte ``offset``; returns at once.

        Raises:
            OffloadIOError: The file does not exist (``errno.ENOENT``), raised right away.
        """
        return self._submit("read", tensor, path, offset)

    def _check(self, tensor: torch.Tensor, offset: int) -> None:
        if self._closed:
            raise RuntimeError("the AsyncIOEngine is closed")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(
                f"swap I/O needs a CPU tensor, got one on {tensor.device}; copy it into a "
                "(pinned) host buffer first"
            )
        if not tensor.is_contiguous():
            raise ValueError("swap I/O needs a contiguous tensor; call .contiguous() first")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        if self.settings.o_direct and offset % ALIGNMENT:
            raise ValueError(
                f"offset {offset} is not a multiple of {ALIGNMENT}, which O_DIRECT requires"
            )

    def _open(self, op: str, path: Path) -> int:
        direct = self.settings.o_direct
        flags = os.O_CLOEXEC | (os.O_WRONLY | os.O_CREAT if op == "write" else os.O_RDONLY)
        if direct:
            flags |= os.O_DIRECT
        try:
            return os.open(path, flags, 0o600)
        except OSError as exc:
            err = exc.errno or errno.EIO
            if err == errno.EINVAL and direct:
                raise direct_io_error(err, path, "at open") from exc
            if err in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full_error(err, path, 0, what="creating") from exc
            hint = "; the file must exist before it is read" if err == errno.ENOENT else ""
            raise OffloadIOError(
                err, f"cannot open {path} for {op}: {os.strerror(err)} [errno {err}]{hint}", path
            ) from exc

    def _submit(
        self, op: str, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int
    ) -> IORequest:
        self._check(tensor, offset)
        file = Path(path)
        nbytes = tensor.numel() * tensor.element_size()
        direct = self.settings.o_direct
        fd = self._open(op, file)
        ops = plan_ops(
            tensor.data_ptr(), nbytes, offset, direct=direct, block_size=self.settings.block_size
        )
        with self._lock:
            inject = self._inject[op].pop(0) if self._inject[op] and ops else 0
        if not ops:
            os.close(fd)
            return IORequest(
                None, op=op, path=file, offset=offset, nbytes=0, direct=direct, tensor=tensor
            )
        if inject:
            first = ops[0]
            ops[0] = Op(first.ptr, first.io_len, first.need, first.offset, first.staged, inject)
        try:
            batch = self._backend.submit(fd, op == "write", direct, ops)
        except BaseException:
            os.close(fd)
            raise
        request = IORequest(
            batch, op=op, path=file, offset=offset, nbytes=nbytes, direct=direct, tensor=tensor
        )
        with self._lock:
            # Finished requests are dropped (releasing their tensors), except failures that no
            # caller has seen yet: wait_all()/close() still report those.
            self._pending = [r for r in self._pending if not r.done() or r._settle()]
            self._pending.append(request)
        return request

    def wait_all(self) -> None:
        """Wait for every request made so far.

        Raises:
            OffloadIOError: The first failure that was not already raised by its request's
                ``wait()`` (raised after every request has finished).
        """
        with self._lock:
            pending, self._pending = self._pending, []
        first: OffloadIOError | None = None
        for request in pending:
            if request._settle() and first is None:
                first = request._error
                request._reported = True
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for the requests made so far, then stop the worker threads. Idempotent."""
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> AsyncIOEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AsyncIOEngine(backend={self.backend_name!r}, settings={self.settings!r})"
