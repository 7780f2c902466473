"""Tensors of collectives kept owned by Python until torch's communication threads let go.

[Note: why collectives hold their tensors until exit]
torch's gloo backend runs each collective on a worker thread (``pt_gloo_runloop``; NCCL's
watchdog thread does the same with its work list), and that thread keeps a reference to the
collective's tensors until a moment after ``wait()`` has returned. If Python has dropped its last
reference first (``mean = mean / world`` right after a synchronous all-reduce does that), the
tensor's Python object survives inside the C++ tensor, and the worker thread must take the GIL
to free it. Once the interpreter has begun to finalize, CPython ends any non-main thread that
asks for the GIL with ``pthread_exit``; the forced unwind runs through a ``noexcept`` C++
destructor, and the process dies in ``std::terminate`` ("terminate called without an active
exception", SIGABRT, exit code 134) after the job itself succeeded. That is a race: it needs
the worker thread to be descheduled between finishing the collective and dropping it, which a
loaded 2-core machine does in a large fraction of runs (torch issue #190489).

The cure here: every collective of :mod:`slipstream.comm` hands torch a fresh alias of each
tensor (``detach()``: same storage, new tensor object) and keeps that alias until torch's
reference count on it falls back to one, i.e. until the worker thread has let go. The worker's
drop is then never the last one, so it never needs the GIL, and the alias itself is freed by the
main thread on the next collective, in :func:`drain` (called by ``comm.destroy()``) or at exit
(an ``atexit`` hook, which runs before the interpreter finalizes).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

import torch

__all__ = ["drain", "held_count", "hold"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_held: list[torch.Tensor] = []
# How long drain() waits at most for torch's threads to release the last collectives. A
# finished collective is released within microseconds of its thread being scheduled; one that
# never completes (its peer died) must not keep a failing job from exiting for long.
_DRAIN_TIMEOUT_S = 5.0


def _torch_holds(tensor: torch.Tensor) -> bool:
    """Whether anything besides the alias's own Python object references it (torch's
    ``Tensor._use_count``; a torch without it gets no protection: nothing is held)."""
    use_count = getattr(tensor, "_use_count", None)
    return use_count is not None and int(use_count()) > 1


def _prune_locked() -> None:
    _held[:] = [tensor for tensor in _held if _torch_holds(tensor)]


def hold(tensor: torch.Tensor) -> torch.Tensor:
    """A new alias of ``tensor`` to pass to a collective; kept until torch releases it."""
    alias = tensor.detach()
    with _lock:
        _prune_locked()
        _held.append(alias)
    return alias


def held_count() -> int:
    """How many collective tensors torch's threads still reference (after pruning)."""
    with _lock:
        _prune_locked()
        return len(_held)


def drain(timeout_s: float = _DRAIN_TIMEOUT_S) -> bool:
    """Wait (GIL released) until torch's threads hold none of the collectives' tensors.

    Returns True when all were released; after ``timeout_s`` logs a warning and returns False
    (a collective still pending, e.g. because a peer died, is left as it is).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with _lock:
            _prune_locked()
            left = len(_held)
            if left == 0:
                return True
        if time.monotonic() >= deadline:
            logger.warning(
                "%d collective tensor(s) still referenced by torch's communication threads after "
                "%.0f s; a collective may still be pending (did a peer rank exit early?)",
                left,
                timeout_s,
            )
            return False
        time.sleep(0.001)  # releases the GIL: a worker thread waiting for it can finish


def _drain_at_exit() -> None:
    with _lock:
        if not _held:
            return
    drain()


atexit.register(_drain_at_exit)
